"""The working-set check on a GPU counts what the caching allocator can still hand out, not the
driver's free memory: blocks it reserves but does not use are free to this process, and
``set_per_process_memory_fraction`` caps it. The CUDA counters are simulated here; the probe in
tests/cuda_probes/ warms a real allocator."""

from __future__ import annotations

import pytest
import torch

from zero_offload.runtime.plan import memory_bounds

GIB = 1 << 30
CUDA0 = torch.device("cuda", 0)


def _simulate(monkeypatch, driver_free: int, total: int, reserved: int, allocated: int, frac):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (driver_free, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: frac)


def test_reserved_unused_blocks_count_as_free(monkeypatch):
    # 80 GiB card: 10 GiB free at the driver, the allocator holds 60 GiB of which 4 are in use.
    _simulate(monkeypatch, 10 * GIB, 80 * GIB, 60 * GIB, 4 * GIB, 1.0)
    assert memory_bounds.free_bytes(CUDA0) == 66 * GIB
    # a 20 GiB working set fits: no MemoryError although the driver reports 10 GiB free
    memory_bounds.check_working_set({"reduce_buffers": 20 * GIB}, 66 * GIB, "cuda")


def test_memory_fraction_caps_what_is_free(monkeypatch):
    _simulate(monkeypatch, 70 * GIB, 80 * GIB, 6 * GIB, 4 * GIB, 0.25)
    assert memory_bounds.free_bytes(CUDA0) == 16 * GIB  # 0.25 * 80 - 4
    with pytest.raises(MemoryError, match="reduce_bucket_size"):
        memory_bounds.check_working_set({"reduce_buffers": 20 * GIB}, 16 * GIB, "cuda")


def test_never_negative(monkeypatch):
    _simulate(monkeypatch, 0, 80 * GIB, 30 * GIB, 30 * GIB, 0.25)
    assert memory_bounds.free_bytes(CUDA0) == 0
