"""fp32 params with the optimizer on the device: the master shard is the params themselves.

Every stage: no master is allocated (no ``device.master_shard`` in the report, and the engine's
expected memory agrees), the update's master views are views of the params' own storage (the flat
buffer at stages 0-2, the device param shard at stage 3), training matches plain PyTorch AdamW,
and a checkpoint saves and restores the aliased master exactly. On two ranks a stage-1/2
partition is one slice per bucket: the master has no single tensor and is read through the flat
buffer's slices. 16-bit params and an offloaded optimizer keep a master of their own."""

from __future__ import annotations

import copy

import pytest
import torch
from distributed import run_ranks
from parity import (
    assert_partitioned_if_asked,
    batches,
    displacement_err,
    engine_config,
    global_step,
    make_model,
    reference,
)

STEPS, MICRO = 3, 2


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _alias_facts(engine) -> list[dict]:
    """Per group: is the master aliased, and does each master view live in the home's storage
    at exactly the home's own offset."""
    out = []
    for og in engine.opt_groups:
        so, home = og.optimizer, og.home
        segs = og.flat.segments(engine.stage >= 1)
        views = so.state.views("master", segs) if so.aliased else []
        own = home.shard_views(segs) if so.aliased else []
        out.append(
            {
                "aliased": so.aliased,
                "same": len(views) == len(own)
                and all(v.data_ptr() == o.data_ptr() for v, o in zip(views, own)),
                "in_home": all(
                    _storage(v)
                    == _storage(og.flat.flat if engine.stage < 3 else home.shard_tensor())
                    for v in views
                ),
                "tensor": so.state.master is not None,
            }
        )
    return out


def train(stage: int, dtype: str = "fp32", offload: bool = False, bucket: int = 100) -> dict:
    import zero_offload
    from zero_offload.core import dist
    from zero_offload.utils import safe_get_full_fp32_param

    world, rank = dist.world_size(), dist.rank()
    zero = {"stage3_param_persistence_threshold": 0} if stage == 3 else None
    cfg = engine_config(stage, offload, 1, MICRO, 0.5, True, dtype, bucket, zero_extra=zero)
    model = make_model()
    engine, *_ = zero_offload.initialize(model=model, config=copy.deepcopy(cfg))
    assert_partitioned_if_asked(model, cfg)
    for x, y in batches(STEPS, world, 1, MICRO):
        global_step(engine, x, y, world, rank)
    named = dict(model.named_parameters())
    trainable = [n for n, p in named.items() if p.requires_grad]
    params = {n: safe_get_full_fp32_param(named[n]).cpu() for n in trainable}
    with zero_offload.zero.GatheredParameters(model.parameters()):
        module = {n: named[n].detach().float().cpu().clone() for n in trainable}
    return {
        "facts": _alias_facts(engine),
        "report": engine.memory_report(),
        "want": engine.expected_memory(),
        "params": params,
        "module": module,
    }


def _check_aliased(r: dict, tensor: bool) -> None:
    assert r["facts"] and all(f["aliased"] and f["same"] and f["in_home"] for f in r["facts"])
    assert all(f["tensor"] == tensor for f in r["facts"])
    # (a frozen param's stage-3 shard is outside the optimizer's formula)
    have = {k: v for k, v in r["report"].items() if not k.startswith("peak.") and "frozen" not in k}
    assert "device.master_shard" not in have  # no master allocation of its own
    assert have == r["want"]
    # the module computes with the updated master: they are one and the same values
    assert all(torch.equal(r["params"][n], r["module"][n]) for n in r["params"])


def _check_reference(r: dict, world: int) -> None:
    init, ref, _, _ = reference(STEPS, world, 1, MICRO, 0.5)
    ref = {n: ref[n] for n in r["params"]}
    assert displacement_err(r["params"], ref, init) < 1e-3


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp32_master_is_the_params(stage):
    r = train(stage)
    _check_aliased(r, tensor=True)  # one rank: the partition is one contiguous range
    _check_reference(r, 1)


@pytest.mark.parametrize("dtype,offload", [("bf16", False), ("fp32", True)])
def test_own_master_where_no_alias(dtype, offload):
    r = train(2, dtype, offload)
    assert not any(f["aliased"] for f in r["facts"])
    where = "host" if offload else "device"
    assert r["report"][f"{where}.master_shard"] > 0


def _world2() -> dict:
    return {stage: train(stage) for stage in (1, 2, 3)}


def test_fp32_master_is_the_params_world2():
    out = run_ranks(2, _world2)
    for stage, r in out.items():
        # stages 1/2: one slice per bucket (several buckets here), no single tensor
        _check_aliased(r, tensor=stage == 3)
        _check_reference(r, 2)
