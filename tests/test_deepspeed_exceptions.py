"""DeepSpeed's exception classes where code catches them: what DeepSpeed refuses with an
``assert`` is an ``AssertionError`` here too (and still an ``EngineUsageError``), and
``save_checkpoint`` refuses an empty ``save_dir`` with DeepSpeed's ``ValueError`` before
anything is written."""

from __future__ import annotations

import pytest
import torch

import zero_offload
from zero_offload.runtime.engine.guards import EngineUsageError


class OneUnused(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = torch.nn.Linear(4, 4)
        self.unused = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x).sum()


def _engine(stage: int, **zero):
    torch.manual_seed(0)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero},
    }
    return zero_offload.initialize(model=OneUnused(), config=cfg)[0]


@pytest.mark.parametrize("stage", [2, 3])
def test_no_sync_with_partitioned_gradients_is_an_assertion(stage: int) -> None:
    engine = _engine(stage)
    with pytest.raises(AssertionError, match="no_sync context manager is incompatible") as info:
        with engine.no_sync():
            pass
    assert isinstance(info.value, EngineUsageError)
    engine.destroy()


def test_step_inside_no_sync_and_reentry_are_assertions() -> None:
    engine = _engine(1)
    with engine.no_sync():
        with pytest.raises(AssertionError, match="reentry"):
            with engine.no_sync():
                pass
        engine.backward(engine(torch.randn(2, 4)))
        with pytest.raises(AssertionError, match="inside no_sync"):
            engine.step()
    engine.destroy()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_unused_params_refused_as_an_assertion(stage: int) -> None:
    engine = _engine(stage, ignore_unused_parameters=False)
    with pytest.raises(AssertionError, match=r"ignore_unused_parameters.*unused\.weight"):
        engine.backward(engine(torch.randn(2, 4)))
    engine.destroy()


@pytest.mark.parametrize("save_dir", [None, ""])
def test_save_checkpoint_refuses_an_empty_save_dir(save_dir, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    engine = _engine(2)
    engine.backward(engine(torch.randn(2, 4)))
    engine.step()
    with pytest.raises(ValueError, match="save_dir must be a non-empty string"):
        engine.save_checkpoint(save_dir)
    assert list(tmp_path.iterdir()) == []
    engine.destroy()


def _different_tags(root: str) -> list:
    import torch.distributed as tdist

    torch.manual_seed(0)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
        "checkpoint": {"tag_validation": "Fail"},
    }
    engine = zero_offload.initialize(model=torch.nn.Linear(4, 4), config=cfg)[0]
    engine.backward(engine(torch.randn(2, 4)).sum())
    engine.step()
    try:
        engine.save_checkpoint(root, tag=f"rank{tdist.get_rank()}")
        got = "saved"
    except AssertionError as e:  # DeepSpeed asserts
        got = type(e).__name__
    engine.destroy()
    out: list = [None] * tdist.get_world_size()
    tdist.all_gather_object(out, got)
    return out


def test_tag_mismatch_under_fail_is_an_assertion_on_every_rank(tmp_path) -> None:
    from distributed import run_ranks

    assert run_ranks(2, _different_tags, str(tmp_path)) == ["TagMismatchError"] * 2
    assert not (tmp_path / "latest").exists()
