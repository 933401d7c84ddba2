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
