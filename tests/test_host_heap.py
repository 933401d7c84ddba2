"""malloc's free heap as a named memory term: ``core/host_heap.py`` reads glibc's own count of
free heap bytes, and the engine reports the most it saw in a step as
``peak.host.allocator_free`` (the freed host memory the resident size carries beyond every
live tensor)."""

from __future__ import annotations

import copy

import pytest
import torch
from parity import batches, engine_config, global_step, make_model

from zero_offload.core import host_heap

glibc = pytest.mark.skipif(host_heap.free_bytes() is None, reason="malloc counts need glibc")


@glibc
def test_free_bytes_counts_freed_heap_blocks():
    """Freeing every other 64 KiB block (below any mmap threshold) leaves holes in the heap
    that the count must show; the live neighbours keep malloc from trimming them away."""
    blocks = [torch.ones(16 * 1024) for _ in range(512)]  # 64 KiB each, 32 MiB in all
    before = host_heap.free_bytes()
    del blocks[::2]
    after = host_heap.free_bytes()
    assert after - before >= 12 * 2**20, (before, after)
    # Handing pages back may also shrink the heap's top (the count then falls): only that it
    # runs and leaves a count to read is certain.
    host_heap.release()
    assert isinstance(host_heap.free_bytes(), int)
    assert len(blocks) == 256


@glibc
def test_engine_reports_the_free_heap_peak():
    import zero_offload

    cfg = engine_config(2, True, 1, 2, 0.5, True)
    engine, *_ = zero_offload.initialize(model=make_model(), config=copy.deepcopy(cfg))
    for x, y in batches(2, 1, 1, 2):
        global_step(engine, x, y, 1, 0)
    report = engine.memory_report()
    assert report["peak.host.allocator_free"] >= 0
    keep = [torch.ones(16 * 1024) for _ in range(256)]
    del keep[::2]  # 8 MiB of holes, then a sample at the next step's end
    for x, y in batches(1, 1, 1, 2):
        global_step(engine, x, y, 1, 0)
    assert engine.memory_report()["peak.host.allocator_free"] >= 6 * 2**20
    engine.reset_peak_memory()
    assert engine.memory_report()["peak.host.allocator_free"] == 0


_SANDWICH = """
import copy, json, sys
import torch
sys.path.insert(0, {tests!r})
from parity import batches, engine_config, global_step, make_model
import zero_offload
from zero_offload.core import host_heap

big = torch.ones(16 * 2**18)  # 16 MiB, mapped; freeing it raises glibc's dynamic threshold
del big
place = {place!r}
cfg = engine_config(3, place, 1, 2, 0.5, True, offload_param=place, nvme_path={path!r})
engine, *_ = zero_offload.initialize(model=make_model(), config=copy.deepcopy(cfg))
for x, y in batches(2, 1, 1, 2):
    global_step(engine, x, y, 1, 0)
# a 2 MiB block between two live ones: freed, it stays in the heap unless it was mapped
left, block, right = torch.ones(2**10), torch.ones(2**19), torch.ones(2**10)
before = host_heap.free_bytes()
del block
print(json.dumps({{"freed_into_heap": host_heap.free_bytes() - before,
                  "report": engine.memory_report()}}))
"""


def _sandwich(place: str, path: str) -> dict:
    import json
    import os
    import subprocess
    import sys

    tests = os.path.dirname(os.path.abspath(__file__))
    code = _SANDWICH.format(tests=tests, place=place, path=path)
    env = {**os.environ, "ZERO_OFFLOAD_DEVICE": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc
def test_nvme_engine_keeps_large_freed_blocks_out_of_the_heap(tmp_path):
    """With a state on NVMe the engine fixes glibc's mmap threshold (``fix_mmap_threshold``):
    a freed block of 2 MiB goes back to the system instead of joining the free heap that
    ``peak.host.allocator_free`` reports, which grew with the model (the step's fetched params
    and gradients landing in different holes). With both offloads "cpu" the dynamic threshold
    stays, and the same block joins the free heap. Each engine runs in its own process: the
    setting is the whole process's."""
    nvme = _sandwich("nvme", str(tmp_path))
    cpu = _sandwich("cpu", str(tmp_path))
    assert "peak.host.allocator_free" in nvme["report"]
    assert nvme["freed_into_heap"] < 2**20, nvme["freed_into_heap"]
    assert cpu["freed_into_heap"] >= 2**21, cpu["freed_into_heap"]


_INIT_ONLY = """
import json, torch
import zero_offload
from zero_offload.core import host_heap

big = torch.ones(16 * 2**18)  # 16 MiB, mapped; freeing it raises glibc's dynamic threshold
del big
cfg = {{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {{"stage": 3,
       "offload_param": {{"device": "nvme", "nvme_path": {path!r}}}}}}}
with zero_offload.zero.Init(config_dict_or_path=cfg):
    model = torch.nn.Linear(8, 8)
left, block, right = torch.ones(2**10), torch.ones(2**19), torch.ones(2**10)
before = host_heap.free_bytes()
del block
print(json.dumps({{"freed_into_heap": host_heap.free_bytes() - before}}))
"""


@glibc
def test_zero_init_with_nvme_params_fixes_the_threshold_before_the_model(tmp_path):
    """``zero.Init`` with params on NVMe fixes the threshold itself, before the model's first
    allocation: the set-up's freed blocks would otherwise leave holes that serve the step's."""
    import json
    import os
    import subprocess
    import sys

    code = _INIT_ONLY.format(path=str(tmp_path))
    env = {**os.environ, "ZERO_OFFLOAD_DEVICE": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    freed = json.loads(out.stdout.strip().splitlines()[-1])["freed_into_heap"]
    assert freed < 2**20, freed
