"""``engine.coalesce_grad_reduction()`` (DeepSpeed's): several ``engine.backward()`` calls in
one block, one reduction at its exit, then one ``step()``, equal to plain data-parallel PyTorch
(DDP's mean over ranks) on the summed losses, at stages 1-3 on two gloo ranks; and DeepSpeed's
refusals (stage 0, ``step()`` inside, nesting with ``no_sync``, a backward after the block)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks

import zero_offload
from zero_offload.utils import safe_get_full_fp32_param


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _engine(stage: int, model: torch.nn.Module):
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    client = torch.optim.SGD(model.parameters(), lr=0.1)
    return zero_offload.initialize(model=model, optimizer=client, config=cfg)[0]


def _coalesced_matches_ddp(stage: int) -> str:
    model = _model()
    ref = copy.deepcopy(model)
    engine = _engine(stage, model)
    if stage == 3:
        assert all(p.numel() == 0 for p in engine.module.parameters())  # partitioned
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    world, rank = dist.get_world_size(), dist.get_rank()
    for step in range(2):
        g = torch.Generator().manual_seed(100 * step)
        xs = [torch.randn(world, 2, 4, generator=g) for _ in range(3)]
        with engine.coalesce_grad_reduction():
            for x in xs:
                engine.backward(engine(x[rank]).pow(2).sum())
        engine.step()
        opt.zero_grad()
        # DDP's mean over ranks of each rank's summed losses
        sum(ref(x[r]).pow(2).sum() for x in xs for r in range(world)).div(world).backward()
        opt.step()
    for p, q in zip(engine.module.parameters(), ref.parameters()):
        torch.testing.assert_close(safe_get_full_fp32_param(p), q)
    engine.destroy()
    return "ok"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_coalesced_backwards_equal_ddp_on_summed_losses(stage: int) -> None:
    assert run_ranks(2, _coalesced_matches_ddp, stage) == "ok"


def test_refusals_as_deepspeed() -> None:
    with pytest.raises(NotImplementedError, match="stage 1/2/3"):
        with _engine(0, _model()).coalesce_grad_reduction():
            pass
    engine = _engine(1, _model())
    x = torch.randn(2, 4)
    with engine.coalesce_grad_reduction():
        with pytest.raises(AssertionError, match="no_sync"):  # before any backward too
            engine.step()
        engine.backward(engine(x).sum())
        with pytest.raises(AssertionError, match="no_sync"):
            engine.step()
        with pytest.raises(AssertionError, match="no_sync"):
            with engine.no_sync():
                pass
    with pytest.raises(RuntimeError, match="coalesce_grad_reduction.*one optimizer step"):
        engine.backward(engine(x).sum())
    engine.step()
    with engine.no_sync():
        with pytest.raises(AssertionError, match="nested"):
            with engine.coalesce_grad_reduction():
                pass
    engine.destroy()
