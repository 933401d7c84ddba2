"""fp32 params with the optimizer beside them: the master shard is the params themselves.

Every stage: no master is allocated (no ``device.master_shard`` in the report, and the engine's
expected memory agrees), the update's master views are views of the params' own storage (the flat
buffer at stages 0-2, the device param shard at stage 3), training matches plain PyTorch AdamW,
and a checkpoint saves and restores the aliased master exactly. On two ranks a stage-1/2
partition is one slice per bucket: the master has no single tensor and is read through the flat
buffer's slices. Stage 3 with both offloads "cpu": the host param shard is the master, updated in
place by the host kernel (no ``host.master_shard``), bitwise the run with a master of its own.
16-bit params and an optimizer away from the params keep a master of their own."""

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


def train(
    stage: int,
    dtype: str = "fp32",
    offload: bool = False,
    bucket: int = 100,
    offload_param: bool = False,
) -> dict:
    import zero_offload
    from zero_offload.core import dist
    from zero_offload.utils import safe_get_full_fp32_param

    world, rank = dist.world_size(), dist.rank()
    zero = {"stage3_param_persistence_threshold": 0} if stage == 3 else None
    cfg = engine_config(
        stage, offload, 1, MICRO, 0.5, True, dtype, bucket, offload_param, zero_extra=zero
    )
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
    assert "host.master_shard" not in have
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


@pytest.mark.parametrize("offload_param", [False, True])
def test_fp32_master_at_stage3_offload(offload_param):
    """Stage 3 with offload_optimizer "cpu": the host param shard is the master where the
    params are offloaded too; a device param shard keeps the host master of its own."""
    r = train(3, offload=True, offload_param=offload_param)
    if offload_param:
        _check_aliased(r, tensor=True)
        assert r["report"]["host.optimizer_state"] > 0
    else:
        assert not any(f["aliased"] for f in r["facts"])
        assert r["report"]["host.master_shard"] > 0
    _check_reference(r, 1)


def test_host_alias_is_bitwise_the_own_master(monkeypatch):
    """The in-place host update computes exactly what a master of its own computed."""
    from zero_offload.runtime.engine import assembly

    aliased = train(3, offload=True, offload_param=True)
    monkeypatch.setattr(assembly, "alias_state", lambda *a, **k: None)
    own = train(3, offload=True, offload_param=True)
    assert not any(f["aliased"] for f in own["facts"]) and own["report"]["host.master_shard"]
    assert all(f["aliased"] for f in aliased["facts"])
    for n in own["params"]:
        assert torch.equal(aliased["params"][n], own["params"][n]), n


def _world2() -> dict:
    out: dict = {stage: train(stage) for stage in (1, 2, 3)}
    out["3+offload"] = train(3, offload=True, offload_param=True)
    return out


def test_fp32_master_is_the_params_world2():
    out = run_ranks(2, _world2)
    for stage, r in out.items():
        # stages 1/2: one slice per bucket (several buckets here), no single tensor
        _check_aliased(r, tensor=stage in (3, "3+offload"))
        _check_reference(r, 2)
