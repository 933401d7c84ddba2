"""``zero-offload estimate`` reproduces the seeds' arithmetic."""

from __future__ import annotations

from zero_offload.cli.main import main
from zero_offload.runtime.engine.memory import expected_bytes


def test_seed_numbers_1p5b_on_8_ranks(capsys):
    assert main(["estimate", "--params", "1.5e9", "--gpus", "8"]) == 0
    rows = {
        tuple(line.split()[:2]): line.split()[2:]
        for line in capsys.readouterr().out.splitlines()[2:]
    }
    assert rows[("0", "none")][2] == "18.00"  # Adam state of a 1.5B model: 18 GB
    assert rows[("1", "none")][2] == "2.25"  # ... 2.25 GB per device with stage 1 on 8 ranks
    assert rows[("1", "none")][0] == "8.25"  # 2 + 2 + 12/8 bytes/param
    assert rows[("2", "none")][0] == "5.62"  # 2 + 14/8
    assert rows[("2", "cpu")][0] == "3.00"  # only the 16-bit params stay on the device


def test_gpt2_model_size(capsys):
    assert (
        main(
            [
                "estimate",
                "--model",
                "gpt2",
                "--num-layers",
                "48",
                "--hidden-size",
                "1600",
                "--num-attention-heads",
                "16",
                "--gpus",
                "1",
                "--stage",
                "2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "1.5" in out.splitlines()[0]  # ~1.56B params (GPT-2 1.5B)


def test_formula_per_param():
    n = 1000
    assert sum(expected_bytes(n, __import__("torch").float16, 0, 4, False).values()) == 16 * n
    off = expected_bytes(n, __import__("torch").bfloat16, 2, 4, True)
    assert (
        off["device.params"] == 2 * n
        and sum(v for k, v in off.items() if k.startswith("device.")) == 2 * n
    )
    assert sum(v for k, v in off.items() if k.startswith("host.")) == (12 + 2 + 2) * n // 4
