"""``zero-offload estimate`` reproduces the seeds' arithmetic."""

from __future__ import annotations

from zero_offload.cli.main import main
from zero_offload.runtime.plan.memory import expected_bytes


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


def test_muon_share_keeps_one_momentum_for_its_params(capsys):
    """``--muon-share``: the Muon group's params keep master + momentum (8 bytes), the aux
    AdamW's master + two moments (12); stages 0-3, with offload on the host."""
    assert main(["estimate", "--params", "1e9", "--gpus", "4", "--muon-share", "0.9"]) == 0
    out = capsys.readouterr().out
    rows = {tuple(line.split()[:2]): line.split()[2:] for line in out.splitlines()[2:]}
    assert set(rows) == {(s, o) for s in "0123" for o in ("none", "cpu")} - {("0", "cpu")}
    assert rows[("3", "none")][2] == "2.10"
    assert rows[("0", "none")][2] == "8.40"  # 0.9 * 8 + 0.1 * 12
    assert rows[("1", "none")][2] == "2.10"  # ... over 4 ranks
    # offload: the same state on the host, with the host grad shard and staging (2 + 2 / 4)
    assert rows[("2", "cpu")][:3] == ["2.00", "3.10", "2.10"]
    assert "Muon (0.9 of the params) + AdamW" in out


def test_formula_per_param():
    n = 1000
    assert sum(expected_bytes(n, __import__("torch").float16, 0, 4, False).values()) == 16 * n
    off = expected_bytes(n, __import__("torch").bfloat16, 2, 4, True)
    assert (
        off["device.params"] == 2 * n
        and sum(v for k, v in off.items() if k.startswith("device.")) == 2 * n
    )
    assert sum(v for k, v in off.items() if k.startswith("host.")) == (12 + 2 + 2) * n // 4


# ---- the step's peak and --max-model ----------------------------------------------------------
GPT2_FLAGS = ["--model", "gpt2", "--num-layers", "4", "--hidden-size", "256",
              "--num-attention-heads", "4", "--seq-length", "128", "--vocab-size", "1024"]  # fmt: skip


def _step_rows(out: str) -> dict:
    lines = out.split("step peak per rank")[1].splitlines()[2:]
    return {tuple(line.split()[:3]): [float(x) for x in line.split()[3:6]] for line in lines}


def test_step_peak_per_placement_is_the_model(capsys):
    from zero_offload.runtime.plan.memory_model import StepShape, ZeroPlan, predict
    from zero_offload.runtime.plan.model_shape import ModelShape

    assert main(["estimate", *GPT2_FLAGS, "--micro-batch", "2", "--dtype", "fp32"]) == 0
    rows = _step_rows(capsys.readouterr().out)
    assert len(rows) == 11  # every stage and placement
    shape = ModelShape.gpt2(4, 256, 4, 1024, 128)
    plan = ZeroPlan(stage=2, dtype_bytes=4, optimizer="host")
    want = predict(shape, StepShape(2, 128), plan)
    assert rows[("2", "cpu", "-")][:2] == [
        round(want[f"peak.{w}.total"] / 1e9, 2) for w in ("device", "host")
    ]
    assert rows[("3", "cpu", "cpu")][0] < rows[("2", "cpu", "-")][0] < rows[("2", "none", "-")][0]


def test_step_peak_of_a_config_and_a_hf_folder(tmp_path, capsys):
    import json

    (tmp_path / "config.json").write_text(json.dumps({
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "vocab_size": 512}))  # fmt: skip
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 3, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}))  # fmt: skip
    assert main(["estimate", "--hf", str(tmp_path), "--config", str(ds), "--seq-length", "32"]) == 0
    out = capsys.readouterr().out
    assert "llama 2x64" in out and "micro batch 3" in out
    assert list(_step_rows(out)) == [("3", "cpu", "cpu")]


def test_max_model_fits_and_one_more_layer_does_not(capsys):
    from zero_offload.runtime.plan.memory_model import StepShape, ZeroPlan, predict
    from zero_offload.runtime.plan.model_shape import ModelShape

    args = ["--max-model", "--device-memory", "2", "--host-memory", "16", "--stage", "2",
            "--seq-length", "512", "--vocab-size", "50257"]  # fmt: skip
    assert main(["estimate", *args]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.split()[:2] == ["2", "cpu"]][0]
    layers, hidden = int(line.split()[4]), int(line.split()[5])
    plan, step = ZeroPlan(stage=2, optimizer="host"), StepShape(1, 512)
    heads = {768: 12, 1024: 16, 1536: 16, 2048: 16, 2560: 32}[hidden]
    fit = predict(ModelShape.gpt2(layers, hidden, heads, 50257, 512), step, plan)
    over = predict(ModelShape.gpt2(layers + 1, hidden, heads, 50257, 512), step, plan)
    assert fit["peak.device.total"] <= 2e9 and fit["peak.host.total"] <= 16e9  # it fits
    assert over["peak.device.total"] > 2e9 or over["peak.host.total"] > 16e9  # the deepest


def test_max_model_needs_a_memory(capsys):
    assert main(["estimate", "--max-model"]) == 2
    assert "--device-memory" in capsys.readouterr().err


def test_max_model_on_a_cpu_adds_device_and_host(capsys):
    """Without --device-memory (a CPU run) the device's terms are host memory too: the largest
    model's two peaks together, with the process's own bytes (malloc's free heap, the interpreter
    and torch), fit --host-memory and one more layer's do not."""
    from zero_offload.cli.estimate.step import CPU_PROCESS_BYTES
    from zero_offload.runtime.plan.memory_model import StepShape, ZeroPlan, predict
    from zero_offload.runtime.plan.model_shape import ModelShape

    args = ["--max-model", "--host-memory", "4", "--stage", "3", "--model", "llama",
            "--seq-length", "32", "--vocab-size", "32000", "--dtype", "fp32"]  # fmt: skip
    assert main(["estimate", *args]) == 0
    out = capsys.readouterr().out
    line = [x for x in out.splitlines() if x.split()[:3] == ["3", "cpu", "cpu"]][0]
    layers, hidden = int(line.split()[4]), int(line.split()[5])
    heads = {768: 12, 1024: 16, 1536: 16, 2048: 16, 2560: 32}[hidden]
    ffn = 256 * -(-(8 * hidden // 3) // 256)
    plan = ZeroPlan(stage=3, dtype_bytes=4, optimizer="host", params="host")

    def total(n: int) -> int:
        pred = predict(ModelShape.llama(n, hidden, heads, 32000, ffn), StepShape(1, 32), plan)
        return pred["peak.device.total"] + pred["peak.host.total"] + CPU_PROCESS_BYTES

    assert total(layers) <= 4e9 < total(layers + 1)
