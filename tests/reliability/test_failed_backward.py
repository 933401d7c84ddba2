"""A backward that raises part way (an out-of-memory error in one layer, say), caught by the
training loop, which zeroes the gradients and goes on, as an automatic batch-size finder does:
the later steps equal a run that never tried that micro-step, bitwise, on every stage, with and
without offload and overlap, on 1 and 2 ranks. The failure comes after some buckets were
already reduced, so the abandoned reductions (in flight on a gloo handle, or on the reduce and
copy streams on CUDA) must finish before ``zero_grad`` clears what they write."""

from __future__ import annotations

import pytest
import torch
from distributed import run_ranks

FAIL = [False]
WIDTH = 16


class _FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        if FAIL[0]:
            raise RuntimeError("injected backward failure")
        return grad


class _Deep(torch.nn.Module):
    """Five layers; the backward fails between the last two and the first three, after the
    buckets of the last ones were launched (each bucket holds about one layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, m in enumerate(self.layers):
            if i == 3:
                x = _FailInBackward.apply(x)
            x = torch.tanh(m(x))
        return x.square().mean()


def _train(stage: int, offload: bool, overlap: bool, fail: bool) -> list[torch.Tensor]:
    import zero_offload
    from zero_offload.core import dist
    from zero_offload.utils import safe_get_full_fp32_param

    torch.manual_seed(0)
    model = _Deep()
    zero = {
        "stage": stage,
        "reduce_bucket_size": WIDTH * WIDTH + WIDTH,
        "allgather_bucket_size": WIDTH * WIDTH + WIDTH,
        "overlap_comm": overlap,
        "stage3_param_persistence_threshold": 0,
    }
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
        "steps_per_print": 10**6,
    }
    engine, *_ = zero_offload.initialize(model=model, config=cfg)
    if stage == 3:
        assert all(p.numel() == 0 < p.ds_numel for p in model.parameters())
    g = torch.Generator().manual_seed(10 + dist.rank())
    for step in range(3):
        if fail and step == 1:  # a micro-step that fails in backward, then is skipped
            FAIL[0] = True
            try:
                with pytest.raises(RuntimeError, match="injected backward failure"):
                    engine.backward(engine(torch.randn(4, WIDTH, generator=g)))
            finally:
                FAIL[0] = False
            engine.zero_grad()
        else:
            torch.randn(4, WIDTH, generator=g)  # the same batches in both runs
        engine.backward(engine(torch.randn(4, WIDTH, generator=g)))
        engine.step()
    return [safe_get_full_fp32_param(p).clone() for p in model.parameters()]


def _compare(stage: int, offload: bool, overlap: bool) -> bool:
    want = _train(stage, offload, overlap, fail=False)
    got = _train(stage, offload, overlap, fail=True)
    return all(torch.equal(a, b) for a, b in zip(want, got))


CASES = [(0, False), (1, False), (2, False), (2, True), (3, False), (3, True)]


@pytest.mark.parametrize("stage,offload", CASES)
def test_failed_backward_then_zero_grad_equals_a_clean_run(stage, offload):
    assert _compare(stage, offload, overlap=True)


@pytest.mark.parametrize("stage,offload", [(0, False), (2, False), (2, True), (3, True)])
def test_failed_backward_on_two_ranks(stage, offload):
    assert run_ranks(2, _compare, stage, offload, True)


@pytest.mark.parametrize("stage,offload", [(0, False), (2, False), (2, True), (3, False)])
def test_zero_grad_mid_window_discards_like_torch(stage, offload):
    """``zero_grad()`` between the micro-steps of a window drops what they accumulated, on
    every stage (the stage-2/3 device shard is then written by the next backward, not added
    into): the step equals torch's on the last micro-step's gradient alone."""
    import zero_offload

    torch.manual_seed(0)
    model = _Deep()
    ref = _Deep()
    ref.load_state_dict(model.state_dict())
    zero = {"stage": stage, "reduce_bucket_size": 300, "stage3_param_persistence_threshold": 0}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
        "zero_optimization": zero,
        "steps_per_print": 10**6,
    }
    engine, *_ = zero_offload.initialize(model=model, config=cfg)
    if stage == 3:
        assert all(p.numel() == 0 < p.ds_numel for p in model.parameters())
    g = torch.Generator().manual_seed(5)
    x1, x2 = torch.randn(4, WIDTH, generator=g), torch.randn(4, WIDTH, generator=g)
    engine.backward(engine(x1))
    engine.step()
    engine.zero_grad()
    engine.backward(engine(x2))
    engine.step()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    (ref(x2) / 2).backward()
    opt.step()
    from zero_offload.utils import safe_get_full_fp32_param

    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(safe_get_full_fp32_param(p), q.detach(), rtol=1e-5, atol=1e-6)
