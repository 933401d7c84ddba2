"""``"optimizer": {"type": "Muon"}`` with ``offload_optimizer`` "cpu" at stages 1 and 2: the
master and the momentum in host memory, Newton-Schulz on the device. It trains like the
published algorithm in plain PyTorch (``muon_reference.py``) on 1 and 2 ranks with gradient
accumulation and clipping, resumes bitwise from a checkpoint that loads with and without
offload, and holds what ``expected_memory()`` says."""

from __future__ import annotations

import pytest
import torch
from distributed import run_ranks
from test_muon import (
    MUON,
    _assert_parity,
    _load_only,
    _memory,
    _reference,
    _save_and_resume,
    _train,
)


@pytest.mark.parametrize(
    "world,stage",
    [
        (1, 1),
        pytest.param(1, 2, marks=pytest.mark.slow),
        pytest.param(2, 1, marks=pytest.mark.slow),
        (2, 2),
        (2, 3),
    ],
)
def test_offloaded_muon_matches_reference(world: int, stage: int) -> None:
    """DeepSpeed's default reduce_scatter (true) with the offload."""
    init, want = _reference()
    got = run_ranks(world, _train, stage, "fp32", "standard", world, True)
    _assert_parity(got, init, want, 1e-4)


def test_offloaded_muon_reduce_scatter_or_not_is_the_same_run() -> None:
    """The step all-gathers each matrix's look-ahead from the ranks' reduced shards, which
    reduce-scatter and all-reduce leave alike: bit for bit the same params."""
    on = run_ranks(2, _train, 2, "fp32", "standard", 2, True)
    off = run_ranks(2, _train, 2, "fp32", "standard", 2, True, {"zero": {"reduce_scatter": False}})
    for n in on:
        assert torch.equal(on[n], off[n]), n


def test_offloaded_muon_at_stage3_with_offload_param() -> None:
    init, want = _reference()
    zero = {"offload_param": {"device": "cpu"}}
    got = run_ranks(2, _train, 3, "fp32", "standard", 2, True, {"zero": zero})
    _assert_parity(got, init, want, 1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("dtype,ns,tol", [("bf16", "gram", 0.15), ("fp16", "standard", 0.05)])
def test_offloaded_muon_16bit_tracks_reference(dtype: str, ns: str, tol: float) -> None:
    """16-bit params: the host master and momentum in fp32, the 16-bit params refreshed from
    the staging buffer; within the 16-bit rounding of the forward. (A constant loss scale
    cancels in Newton-Schulz's normalization: the fp32 cases, with clipping active, are the
    ones that check the factor.)"""
    init, want = _reference()
    got = run_ranks(2, _train, 2, dtype, ns, 2, True)
    for n in MUON:
        err = (got[n].float() - want[n]).norm() / (want[n] - init[n]).norm()
        assert err < tol, f"{n}: {float(err):.2e} of its move"


@pytest.mark.parametrize("offload_saved", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_offloaded_muon_checkpoint_resumes_and_loads_across_offload(
    tmp_path, offload_saved: bool
) -> None:
    """Stage 2 on 2 ranks: the resumed step equals the uninterrupted one bit for bit (the host
    momentum buffer included); the checkpoint loads on 1 rank at stage 1 with the other
    offload setting and holds the same values."""
    saved, straight, resumed = run_ranks(2, _save_and_resume, str(tmp_path), 2, offload_saved)
    assert any(k.endswith("momentum_buffer") and v.abs().sum() > 0 for k, v in saved.items())
    for k in straight:
        assert torch.equal(straight[k], resumed[k]), k
    loaded = run_ranks(1, _load_only, str(tmp_path), 1, not offload_saved)
    for k in saved:
        assert torch.equal(saved[k], loaded[k]), k


@pytest.mark.parametrize("world,stage,dtype", [(2, 2, "bf16"), (1, 1, "fp32"), (2, 3, "fp32")])
def test_offloaded_muon_state_is_the_host_momentum(world: int, stage: int, dtype: str) -> None:
    """The Muon group's state is in host memory, one fp32 momentum per element of its shard
    beside the master, and the engine's memory formula says what it allocated."""
    r = run_ranks(world, _memory, stage, dtype, True)
    assert r["muon"]["host.optimizer_state"] == 4 * r["shard"]
    assert r["muon"]["host.master_shard"] == 4 * r["shard"]
    assert not any(k.startswith("device.") for k in r["muon"]), r["muon"]
    assert r["have"] == r["want"]
