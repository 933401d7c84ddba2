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
    found[f"group{{og.index}}.staging"] = getattr(og.optimizer, "staging", None)
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
