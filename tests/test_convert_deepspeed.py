"""DeepSpeed checkpoints in: checkpoints made by DeepSpeed 0.19.8 itself (on the CPU, with
tests/deepspeed_checkpoint.py; small, committed under tests/ds_fixtures/) are converted and
loaded, and training continues exactly where DeepSpeed's did."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
from parity import batches, make_model

import zero_offload
from zero_offload.checkpoint import CheckpointError
from zero_offload.checkpoint.deepspeed import convert_deepspeed_checkpoint
from zero_offload.cli.main import main
from zero_offload.utils import safe_get_full_fp32_param

FIXTURES = Path(__file__).parent / "ds_fixtures"
CASES = sorted(p.name for p in FIXTURES.iterdir() if (p / "latest").is_file())


def _engine(stage: int, offload: bool, bf16: bool = False):
    """The fixture generator's model, param groups and config, on this project's engine."""
    model = make_model()
    groups = [
        {"params": [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]},
        {
            "params": [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2],
            "weight_decay": 0.0,
        },
    ]
    zero = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 5}},
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
    }
    engine, *_ = zero_offload.initialize(model=model, model_parameters=groups, config=cfg)
    return engine, model


def _masters(model) -> dict[str, torch.Tensor]:
    return {n: safe_get_full_fp32_param(p) for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("stage,offload", [(2, True), (1, False)])
def test_converted_checkpoint_resumes_where_deepspeed_stopped(case, stage, offload, tmp_path):
    src = FIXTURES / case
    expected = torch.load(src / "expected.pt", weights_only=True)
    out = convert_deepspeed_checkpoint(src, tmp_path / "converted")
    assert out == tmp_path / "converted" / "global_step2"
    engine, model = _engine(stage, offload, bf16="bf16" in case)
    engine.load_checkpoint(str(tmp_path / "converted"))
    got = _masters(model)
    assert set(got) == set(expected["master"])
    for name, want in expected["master"].items():
        assert torch.equal(got[name], want), name  # bitwise: fp32 master, re-sliced
    assert engine.global_steps == expected["global_steps"]
    assert engine.get_lr() == pytest.approx(expected["lr"], rel=1e-12)
    assert (
        engine.lr_scheduler.state_dict()["last_batch_iteration"]
        == (expected["scheduler"]["last_batch_iteration"])
    )
    # The next step (DeepSpeed's own continuation is in expected.pt): Adam moments, step count,
    # bias correction and schedule must all be right for this to match.
    x, y = batches(expected["global_steps"] + 1, 1, 2, 2)[-1]
    for k in range(2):
        engine.backward(engine(x[2 * k : 2 * k + 2], y[2 * k : 2 * k + 2]))
        engine.step()
    after = _masters(model)
    init = expected["master"]
    num = sum(float((after[n] - t).square().sum()) for n, t in expected["next_master"].items())
    den = sum(float((t - init[n]).square().sum()) for n, t in expected["next_master"].items())
    # fp32: only summation order differs (< 1e-4); bf16: the 16-bit forward/backward and the
    # gradient accumulation dtype differ from DeepSpeed's too. A missing moment or step gives ~1.
    tolerance = 2e-2 if "bf16" in case else 1e-4
    assert (num / den) ** 0.5 < tolerance


def test_load_checkpoint_on_a_deepspeed_folder_names_the_converter():
    engine, _ = _engine(2, False)
    with pytest.raises(CheckpointError, match="zero-offload convert-deepspeed"):
        engine.load_checkpoint(str(FIXTURES / CASES[0]))


def test_cli_converts_and_reports_errors_on_stderr(tmp_path, capsys):
    assert main(["convert-deepspeed", str(FIXTURES / CASES[0]), str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "latest").read_text() == "global_step2"
    assert (tmp_path / "out" / "global_step2" / "meta.json").is_file()
    capsys.readouterr()
    assert main(["convert-deepspeed", str(tmp_path / "nothing"), str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zero-offload convert-deepspeed: error:") and len(err.splitlines()) == 1


class _Evil:
    """Pickles to a call of os.system: what a hostile checkpoint would contain."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickled_code_is_never_run(tmp_path):
    marker = tmp_path / "pwned"
    folder = tmp_path / "ds" / "global_step1"
    folder.mkdir(parents=True)
    (tmp_path / "ds" / "latest").write_text("global_step1")
    with open(folder / "mp_rank_00_model_states.pt", "wb") as f:
        pickle.dump({"module": {}, "param_shapes": [], "x": _Evil(marker)}, f)
    with pytest.raises(CheckpointError, match="allowlist"):
        convert_deepspeed_checkpoint(tmp_path / "ds", tmp_path / "out")
    assert not marker.exists()
