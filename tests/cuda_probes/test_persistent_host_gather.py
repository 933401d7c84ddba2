"""GPU probe: stage 3 with ``offload_param`` "cpu" gathers its persistent slots with queued
copies out of the pinned host shard (no blocking copy per slot). The copies are held back with
``torch.cuda._sleep``; after every step each persistent slot's gathered values must still equal
the host shard's (the update may rewrite the shard only after they landed)."""

from __future__ import annotations

import pytest
import torch
from parity import batches, engine_config, make_model

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_persistent_slots_equal_the_host_shard(monkeypatch):
    import zero_offload
    from zero_offload.runtime.stage3.param_store import ParamStore

    orig = ParamStore._read_own

    def held(self, slot, cache=True):
        torch.cuda._sleep(5_000_000)  # the copy after it waits on the compute stream
        return orig(self, slot, cache)

    monkeypatch.setattr(ParamStore, "_read_own", held)
    cfg = engine_config(
        3,
        True,
        1,
        2,
        0.0,
        overlap=True,
        dtype="bf16",
        offload_param=True,
        zero_extra={"stage3_param_persistence_threshold": 10**9},
    )
    engine, *_ = zero_offload.initialize(model=make_model(), config=cfg)
    store = engine.param_store
    persistent = [s for s in store.slots if s.persistent]
    assert persistent and store.shards[0] is not None and store.shards[0].is_pinned()
    for x, y in batches(3, 1, 1, 2):
        engine.backward(engine(x.to(engine.device), y.to(engine.device)))
        engine.step()
        torch.cuda.synchronize()
        for s in persistent:
            n = s.bucket.slice_numel
            assert torch.equal(s.buf[:n].cpu(), orig(store, s, False)), s.label
    engine.destroy()
