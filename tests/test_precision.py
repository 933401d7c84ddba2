"""bf16 and fp16 runs track the fp32 loss curve; an fp16 overflow skips the step on every rank
with master weights bit-identical and the loss scale moving as DeepSpeed's does."""

from __future__ import annotations

import pytest
import torch
from distributed import run_ranks
from parity import batches, engine_config, make_model, run_engine

SETUPS = [(0, False), (1, False), (2, False), (2, True)]


def curves(dtype: str) -> dict:
    out = {}
    for stage, offload in SETUPS:
        cfg = engine_config(
            stage=stage, offload=offload, gas=2, micro=2, clip=1.0, overlap=True, dtype=dtype
        )
        out[(stage, offload)] = run_engine(cfg, 5, 2, 2)[3]
    return out


def _track(dtype: str, world_fn) -> None:
    fp32 = world_fn("fp32")
    low = world_fn(dtype)
    for key in SETUPS:
        for a, b in zip(low[key], fp32[key]):
            assert abs(a - b) < 2e-2 * abs(b), (dtype, key, low[key], fp32[key])


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_low_precision_tracks_fp32(dtype):
    _track(dtype, curves)


def _curves_world2(dtype):
    return run_ranks(2, curves, dtype)


@pytest.mark.slow
def test_bf16_tracks_fp32_world2():
    _track("bf16", _curves_world2)


def overflow_case(stage: int, offload: bool) -> dict:
    import zero_offload
    from zero_offload.core import dist
    from zero_offload.utils import safe_get_full_fp32_param

    cfg = engine_config(
        stage=stage, offload=offload, gas=1, micro=2, clip=1.0, overlap=True, dtype="fp16"
    )
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 2}
    model = make_model()
    engine, *_ = zero_offload.initialize(model=model, config=cfg)
    trainable = [p for p in model.parameters() if p.requires_grad]
    ((x, y),) = batches(1, dist.world_size(), 1, 2)
    r = dist.rank()
    xs, ys = x[r * 2 : r * 2 + 2], y[r * 2 : r * 2 + 2]
    engine.backward(engine(xs, ys))
    engine.step()  # one clean step
    before = [safe_get_full_fp32_param(p) for p in trainable]
    device_before = [p.detach().clone() for p in model.parameters()]
    adam_steps = [so.step_count for so in (og.optimizer for og in engine.opt_groups)]
    scales = []
    for _ in range(2):
        loss = engine(xs, ys)
        # Only rank 0 overflows: every rank must still skip.
        engine.backward(loss * (1e6 if r == 0 else 1.0))
        engine.step()
        scales.append(engine.loss_scale)
    after = [safe_get_full_fp32_param(p) for p in trainable]
    return {
        "bit_identical": all(torch.equal(a, b) for a, b in zip(before, after)),
        "device_identical": all(
            torch.equal(a, p.detach()) for a, p in zip(device_before, model.parameters())
        ),
        "adam_steps_same": adam_steps
        == [so.step_count for so in (og.optimizer for og in engine.opt_groups)],
        "scales": scales,
        "skipped": engine.skipped_steps,
        "global_steps": engine.global_steps,
        "norm": engine.get_global_grad_norm(),
    }


def _assert_overflow(r: dict) -> None:
    assert r["bit_identical"] and r["device_identical"] and r["adam_steps_same"], r
    assert r["scales"] == [256.0, 128.0], r  # hysteresis 2: first overflow absorbed, second halves
    assert r["skipped"] == 2 and r["global_steps"] == 3 and r["norm"] is None, r


@pytest.mark.parametrize("stage,offload", [(0, False), (2, False), (2, True)])
def test_fp16_overflow_skips_step(stage, offload):
    _assert_overflow(overflow_case(stage, offload))


def _overflow_world2():
    return [overflow_case(s, o) for s, o in [(1, False), (2, True)]]


def test_fp16_overflow_on_one_rank_skips_everywhere():
    for r in run_ranks(2, _overflow_world2):
        _assert_overflow(r)
