"""Host memory of NVMe offload bounded by the config for the whole model: the param read cache
holds at most ``offload_param.buffer_count`` slices and ``max_in_cpu`` elements across every
group's shard, and ``memory_report()`` accounts its peak (``peak.host.param_buffers``)."""

from __future__ import annotations

import torch

from zero_offload.nvme.io.aio import AioEngine, AioPolicy
from zero_offload.nvme.param_cache import ParamCache
from zero_offload.nvme.param_shard import NvmeParamShard


def test_one_cache_bounds_every_shard_together(tmp_path):
    """Two shards sharing a cache: together at most 3 slices and 6000 elements (with a bound
    per shard they held twice that)."""
    aio = AioEngine(AioPolicy())
    cache = ParamCache(max_in_cpu=6000, max_slices=3)
    shards = [
        NvmeParamShard(tmp_path, f"p{i}", 20_000, torch.bfloat16, aio, False, 6000, cache)
        for i in range(2)
    ]
    refs = [torch.randn(20_000).bfloat16() for _ in shards]
    for nv, ref in zip(shards, refs):
        nv.write(0, ref)
    for lo in range(0, 18_000, 1500):
        for nv, ref in zip(shards, refs):
            nv.read_ahead(lo + 1500, lo + 3000)
            assert torch.equal(nv.read(lo, lo + 1500), ref[lo : lo + 1500])
            assert len(cache.entries) <= 3
            assert cache.cached + cache.spare <= 6000, (cache.cached, cache.spare)
    assert sum(nv.cached for nv in shards) == cache.cached
    assert cache.peak_slices == 3
    for nv in shards:
        nv.close()


class _Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(24))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.layers:
            x = x + torch.tanh(m(x))
        return x.square().mean()


def test_stage3_param_cache_holds_buffer_count_slices(tmp_path):
    """Both states on NVMe, the default max_in_cpu (far above the model): the read cache holds
    at most buffer_count slices, never the whole param shard (it kept every slice it had read
    while they fit in max_in_cpu), and its peak is in memory_report()."""
    import zero_offload

    torch.manual_seed(0)
    block = {"device": "nvme", "nvme_path": str(tmp_path)}
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 0,  # the slices come from the NVMe read-ahead
            "sub_group_size": 2048,
            "offload_optimizer": dict(block),
            "offload_param": {**block, "buffer_count": 2},
        },
        "steps_per_print": 10**9,
    }
    engine, *_ = zero_offload.initialize(model=_Mlp(), config=cfg)
    assert all(p.numel() == 0 < p.ds_numel for p in engine.module.parameters())
    store = engine.param_store
    assert len(store.slots) > 2
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        engine.backward(engine(torch.randn(4, 64, generator=g)))
        engine.step()
    cache = store.nvme.cache
    assert 0 < cache.peak_slices <= 2
    assert sum(nv.ahead_hits for nv in store.swapped.values()) > 0
    report = engine.memory_report()
    shard_bytes = report["nvme.param_shard"]
    assert 0 < report["peak.host.param_buffers"] < shard_bytes / 2, report
    engine.destroy()
