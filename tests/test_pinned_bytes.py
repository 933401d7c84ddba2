"""Pinned host buffers counted as the bytes they reserve (``core/pinned_bytes.py``), with CUDA
simulated on the CPU: the caching host allocator's power-of-two rounding for small buffers, the
exact size for the large ones registered in place, and every pinned buffer through
``alloc_host``. Unpinned buffers (the CPU path) count their own bytes as before."""

from __future__ import annotations

import pytest
import torch

from zero_offload.core import pinned_bytes, streams
from zero_offload.core.pinned_bytes import REGISTER_MIN_BYTES, cached_bytes, host_bytes, reserved
from zero_offload.nvme.io import aio as aio_mod
from zero_offload.nvme.io.aio import AioEngine, AioPolicy
from zero_offload.nvme.param_cache import ParamCache
from zero_offload.nvme.param_shard import NvmeParamShard


def test_caching_allocator_rounds_to_a_power_of_two():
    assert [cached_bytes(n) for n in (0, 1, 3, 4096, 4097, 6000)] == [0, 1, 4, 4096, 8192, 8192]
    assert cached_bytes(REGISTER_MIN_BYTES - 1) == REGISTER_MIN_BYTES
    assert cached_bytes((48 << 20) + 1) == 64 << 20


def test_reserved_bytes_by_path():
    assert reserved(5000, pinned=False) == 5000  # pageable: its own bytes
    assert reserved(5000, pinned=True) == 8192  # the caching allocator's block
    big = REGISTER_MIN_BYTES + 12345
    assert reserved(big, pinned=True) == big  # registered at its exact size


def test_host_bytes_of_a_simulated_pinned_buffer(monkeypatch):
    buf = torch.empty(1250, dtype=torch.float32)  # 5000 bytes
    assert host_bytes(buf) == 5000  # not pinned (the CPU)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
    assert host_bytes(buf) == 5000  # CUDA not initialized: nothing can be pinned
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert host_bytes(buf) == 8192
    assert host_bytes(buf.view(50, 25)) == 8192  # a view counts its allocation
    pinned_bytes.note_registered(buf)
    try:
        assert host_bytes(buf) == 5000  # registered in place: exact
    finally:
        pinned_bytes.note_unregistered(buf.data_ptr())
    assert host_bytes(buf) == 8192


class _Registrar:
    """Stands in for ``streams._registered``: records the sizes asked for."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def __call__(self, numel: int, dtype: torch.dtype, nbytes: int) -> torch.Tensor:
        self.asked.append(nbytes)
        t = torch.empty(numel, dtype=dtype)
        pinned_bytes.note_registered(t)
        return t


def test_large_pinned_buffer_goes_the_registered_path(monkeypatch):
    reg = _Registrar()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(streams, "_registered", reg)
    numel = REGISTER_MIN_BYTES // 4 + 3
    big = streams.alloc_host(numel, torch.float32, pin=True)
    assert reg.asked == [numel * 4]
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert host_bytes(big) == numel * 4  # exact, not the 128 MiB power of two
    pinned_bytes.note_unregistered(big.data_ptr())


def test_small_pinned_buffer_stays_with_the_caching_allocator(monkeypatch):
    reg = _Registrar()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(streams, "_registered", reg)
    monkeypatch.setattr(streams, "_warned", True)  # the CPU refuses pin_memory: no warning
    small = streams.alloc_host(1250, torch.float32, pin=True)
    assert reg.asked == [] and small.numel() == 1250


def test_aligned_nvme_buffers_are_allocated_through_alloc_host(monkeypatch):
    asked: list[tuple[int, bool]] = []

    def fake_alloc(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        asked.append((numel, pin))
        return torch.empty(numel + aio_mod.ALIGN, dtype=dtype)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(aio_mod, "alloc_host", fake_alloc)
    buf = aio_mod.aligned_empty(5000, pin=True)
    assert buf.numel() == 8192 and buf.data_ptr() % aio_mod.ALIGN == 0
    assert asked and all(pin for _, pin in asked)
    asked.clear()
    aio_mod.aligned_empty(5000, pin=False)
    assert asked == []  # pageable buffers stay out of it


@pytest.mark.parametrize("pin", [False, True])
def test_max_in_cpu_counts_reserved_elements(tmp_path, pin):
    """A pinned slice of 3000 bf16 elements (6000 bytes, two 4096-byte blocks) reserves an
    8192-byte block: 4096 elements against ``max_in_cpu``; unpinned it counts its 3000."""
    cache = ParamCache(max_in_cpu=7000, max_slices=8)
    nv = NvmeParamShard(
        tmp_path, "p", 20_000, torch.bfloat16, AioEngine(AioPolicy()), pin, 7000, cache
    )
    try:
        nv.write(0, torch.randn(20_000).bfloat16())
        nv.flush()
        assert nv.charge(0, 3000) == (4096 if pin else 3000)
        nv.read(0, 3000)
        nv.read(3000, 6000)
        assert cache.cached <= 7000
        assert len(cache.entries) == (1 if pin else 2)  # two pinned slices do not fit
        assert nv.nbytes()["host.param_cache"] == cache.cached * 2
    finally:
        nv.close()


def test_predicted_host_terms_round_pinned_buffers():
    """``expected_memory``'s plan on CUDA: each pinned host buffer as the allocator holds it;
    unpinned (the CPU) the same terms as before."""
    import dataclasses

    from zero_offload.runtime.plan.memory_model import ZeroPlan, states

    plan = ZeroPlan(stage=2, dtype_bytes=2, world=1, optimizer="host")
    plain = states(3000, plan)
    assert plain["host.grad_shard"] == 6000 and plain["host.param_staging"] == 6000
    pinned = states(3000, dataclasses.replace(plan, pin_optimizer=True))
    assert pinned["host.grad_shard"] == 8192 and pinned["host.param_staging"] == 8192
    delayed = dataclasses.replace(plan, pin_optimizer=True, delayed=True)
    assert states(3000, delayed)["host.grad_shard"] == 2 * 8192  # two buffers, each rounded
    assert pinned["host.master_shard"] == plain["host.master_shard"]  # pageable


def test_offloaded_states_count_their_host_copies_as_held(monkeypatch):
    """``offload_states``' host copies: the report's host term is what each copy reserves."""
    from zero_offload.runtime.offload_states.storage_move import StorageMover

    mover = StorageMover()
    mover.offload(torch.ones(1250), {"s"}, "device.master_shard", False, False, True)
    assert mover.moved_bytes() == mover.held_bytes() == {"device.master_shard": 5000}
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert mover.held_bytes() == {"device.master_shard": 8192}
    assert mover.moved_bytes() == {"device.master_shard": 5000}  # the device's bytes
