"""The engine's large host buffers are not ``malloc``'s (``core/host_memory.py``): each is an
anonymous mapping of its own, so none lands in glibc's heap, where what a step frees around it
would stay resident as free heap. Checked by the process's own memory map, not by timing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from zero_offload.core import host_memory

linux = pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps")


@linux
def test_helper_maps_large_buffers_and_leaves_small_ones_to_malloc():
    big = host_memory.zeros(host_memory.MAP_MIN_BYTES // 4, torch.float32)
    assert host_memory.is_mapped(big) and big.abs().sum().item() == 0.0
    assert host_memory.is_mapped(host_memory.empty(1 << 20, torch.bfloat16)[7:])  # a view too
    assert not host_memory.is_mapped(host_memory.empty(16, torch.float32))  # malloc's
    assert not host_memory.is_mapped(torch.empty(1 << 22))  # malloc's own mapped chunk
    view = host_memory.empty(1 << 20, torch.float32)[10:20]  # the mapping outlives its base
    view.fill_(2.0)
    assert view.sum().item() == 20.0


@linux
def test_stage3_linear_weight_grad_is_mapped_and_equal():
    """Stage 3's memory-efficient linear writes a large weight gradient into a mapping of its
    own (freed once reduced, it would otherwise stay in the heap), bitwise the plain product;
    under grad mode (a double backward) it keeps the plain product."""
    from zero_offload.runtime.stage3.memory_efficient_linear import _weight_grad

    g = torch.Generator().manual_seed(0)
    g2, x2 = torch.randn(64, 1024, generator=g), torch.randn(64, 512, generator=g)
    with torch.no_grad():
        out = _weight_grad(g2, x2)
    assert host_memory.is_mapped(out) and out.shape == (1024, 512)
    assert torch.equal(out, g2.t().matmul(x2))
    with torch.enable_grad():
        assert not host_memory.is_mapped(_weight_grad(g2, x2))


# Run in a fresh process: glibc's dynamic mmap threshold is process state. Raising it first (a
# 30 MiB block mapped and freed) puts every later malloc block below 30 MiB in the heap, as a
# training process's first step does; the engine's buffers must not be among them.
_ENGINE = """
import json, sys
import torch
import zero_offload
from zero_offload.core import host_memory

big = torch.ones(30 * 2**18)
del big
stage, dtype = {stage}, {dtype!r}
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(3)])
zc = {{"stage": stage, "offload_optimizer": {{"device": "cpu"}}, "reduce_bucket_size": 1e6}}
if stage == 3:
    zc["offload_param"] = {{"device": "cpu"}}
cfg = {{"train_micro_batch_size_per_gpu": 2, "zero_optimization": zc,
       "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3}}}}}}
if dtype == "bf16":
    cfg["bf16"] = {{"enabled": True}}
engine, *_ = zero_offload.initialize(model=model, model_parameters=model.parameters(), config=cfg)
lowp = torch.bfloat16 if dtype == "bf16" else torch.float32
for step in range(2):
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(step)).to(lowp)
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
found = {{}}
for og in engine.opt_groups:
    st = og.state
    for kind in ("master", "exp_avg", "exp_avg_sq"):
        found[f"group{{og.index}}.{{kind}}"] = getattr(st, kind, None)
    for i, t in enumerate(og.grads.host):
        found[f"group{{og.index}}.host_grad{{i}}"] = t
    found[f"group{{og.index}}.staging"] = getattr(og.optimizer.staging, "buffer", None)
if engine.param_store is not None:
    for gi, t in enumerate(engine.param_store.shards):
        found[f"group{{gi}}.param_shard"] = t
large = {{k: t for k, t in found.items()
         if t is not None and t.numel() * t.element_size() >= host_memory.MAP_MIN_BYTES}}
print(json.dumps({{k: host_memory.is_mapped(t) for k, t in large.items()}}))
"""


@linux
@pytest.mark.parametrize(
    "stage,dtype", [(3, "fp32"), (2, "bf16")], ids=["stage3-fp32", "stage2-bf16"]
)
def test_engine_host_buffers_are_not_malloc_heap(stage: int, dtype: str):
    """Offload "cpu": the optimizer state (master, moments), the host gradient shards, the
    16-bit staging (bf16) and the stage-3 host param shard are each a mapping of its own.
    Before ``host_memory``, each was a ``torch.empty``: a block in the heap once the dynamic
    threshold had risen, else one of ``malloc``'s mapped chunks (never page-aligned)."""
    code = _ENGINE.format(stage=stage, dtype=dtype)
    env = {**os.environ, "ZERO_OFFLOAD_DEVICE": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    mapped = json.loads(out.stdout.strip().splitlines()[-1])
    # Not vacuous: the master, both moments and a host gradient shard at the least.
    assert len(mapped) >= 4, mapped
    assert any("host_grad" in k for k in mapped) and any("exp_avg_sq" in k for k in mapped)
    if stage == 3:
        assert any("param_shard" in k for k in mapped), mapped
    assert all(mapped.values()), {k: v for k, v in mapped.items() if not v}


def _reduce_scatter_calls(stage: int, reduce_scatter: bool) -> dict:
    """One rank: 2 steps with offload "cpu"; how often the engine called the process group's
    reduce-scatter, and the losses."""
    from parity import batches, engine_config, global_step, make_model

    import zero_offload
    from zero_offload.core import dist

    calls = []
    real = dist._reduce_scatter
    dist._reduce_scatter = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        zero = {"reduce_scatter": reduce_scatter}
        cfg = engine_config(stage, True, 1, 2, 0.0, False, zero_extra=zero)
        if stage == 3:
            cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
        engine, *_ = zero_offload.initialize(model=make_model(), config=cfg)
        w, r = dist.world_size(), dist.rank()
        losses = [global_step(engine, x, y, w, r) for x, y in batches(2, w, 1, 2)]
    finally:
        dist._reduce_scatter = real
    return {"calls": len(calls), "losses": losses}


@pytest.mark.parametrize("stage", [2, 3])
def test_gloo_reduction_makes_no_bucket_sized_copy(stage: int):
    """On gloo, torch's reduce-scatter clones the whole bucket, all-reduces the clone and copies
    a slice out: a bucket-sized malloc block per reduction, which stayed resident as free heap.
    The reducer all-reduces the bucket (scratch) in place instead: the same sums (the losses
    equal ``reduce_scatter: false``'s bitwise), and no reduce-scatter is issued."""
    from distributed import run_ranks

    rs = run_ranks(2, _reduce_scatter_calls, stage, True)
    ar = run_ranks(2, _reduce_scatter_calls, stage, False)
    assert rs["calls"] == 0, rs
    assert rs["losses"] == ar["losses"], (rs, ar)
