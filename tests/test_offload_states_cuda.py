"""offload_states on a GPU: the allocator's allocated bytes drop by at least what the memory
report moved (blocks are rounded up), the module's params are pinned host copies (a forward
through ``engine.module`` is a device mismatch, as with DeepSpeed), and after reload (blocking
or not) training continues bit for bit. Skipped without an NVIDIA GPU."""

from __future__ import annotations

import copy

import pytest
import torch
from parity import batches, engine_config, make_model

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

STEPS, MICRO = 4, 2


def _moved(before: dict, after: dict) -> int:
    skip = ("gathered_params", "persistent_params")
    return sum(
        before[k] - after.get(k, 0)
        for k in before
        if k.startswith("device.") and not k.endswith(skip)
    )


def _offload_and_check(engine, x, y, non_blocking: bool) -> None:
    torch.cuda.synchronize()
    a0, r0 = torch.cuda.memory_allocated(), engine.memory_report()
    engine.offload_states(pin_memory=True, non_blocking=non_blocking)
    torch.cuda.synchronize()
    a1, moved = torch.cuda.memory_allocated(), _moved(r0, engine.memory_report())
    assert moved > 0 and a0 - a1 >= moved
    if engine.stage < 3:
        assert all(
            p.device.type == "cpu" and p.is_pinned() for p in engine.opt_groups[0].flat.params
        )
        with pytest.raises(RuntimeError):  # a device mismatch, not a read of freed memory
            engine.module(x, y)
    engine.reload_states(non_blocking=non_blocking)
    assert torch.cuda.memory_allocated() - a1 >= moved


def _run(stage: int, offload: bool, non_blocking: bool = False) -> list[torch.Tensor]:
    import zero_offload

    zero = {"stage3_param_persistence_threshold": 0} if stage == 3 else None
    cfg = engine_config(stage, False, 1, MICRO, 0.5, True, "bf16", 100, zero_extra=zero)
    model = make_model()
    engine, *_ = zero_offload.initialize(model=model, config=copy.deepcopy(cfg))
    for i, (x, y) in enumerate(batches(STEPS, 1, 1, MICRO)):
        x, y = x.cuda(), y.cuda()
        if i == 2 and offload:
            _offload_and_check(engine, x, y, non_blocking)
        engine.backward(engine(x, y))
        engine.step()
    with zero_offload.zero.GatheredParameters(model.parameters()):
        return [p.detach().cpu().clone() for p in model.parameters()]


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("non_blocking", [False, True])
def test_cuda_offload_frees_allocated_bytes_and_resumes_bitwise(stage, non_blocking):
    got, ref = _run(stage, True, non_blocking), _run(stage, False)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
