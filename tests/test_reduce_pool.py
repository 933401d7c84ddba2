"""Stage 2/3 reduce buffers are a pool kept for the run: at most two buffers, each within
``reduce_bucket_size``, the same ones every backward (no allocation per bucket), accounted in the
memory report; and nothing that a gradient overwrites is zeroed first, yet padding, a param
without a gradient (the model's unused one) and the gaps of a piece reduce as zeros: buffers
filled with NaN before a backward give the same training, bit for bit; and a buffer reused within
a backward leaves nothing of its last bucket in the next one's padding (the gradient norm, which
counts the padding, and so the clipped update are unchanged). On one rank with a device grad
shard there is no buffer at all: the hooks fill the grad shard itself."""

from __future__ import annotations

import copy

import torch
from distributed import run_ranks
from parity import (
    assert_partitioned_if_asked,
    batches,
    engine_config,
    global_step,
    make_model,
    reference,
)

STEPS, MICRO, BUCKET = 3, 2, 100  # the tied embedding (512) and a linear unit (408) are larger


def train(stage: int, poison: bool, offload: bool) -> dict:
    import zero_offload
    from zero_offload.core import dist
    from zero_offload.utils import safe_get_full_fp32_param

    world, rank = dist.world_size(), dist.rank()
    zero = {"stage3_param_persistence_threshold": 0} if stage == 3 else None
    cfg = engine_config(stage, offload, 1, MICRO, 0.5, True, "fp32", BUCKET, zero_extra=zero)
    model = make_model()
    engine, *_ = zero_offload.initialize(model=model, config=copy.deepcopy(cfg))
    assert_partitioned_if_asked(model, cfg)
    bufs = engine.reducer.bufs
    kept, norms = [], []
    for x, y in batches(STEPS, world, 1, MICRO):
        if poison:  # whatever a buffer held before must not reach a gradient
            for base in bufs.pool.bases:
                base.fill_(float("nan"))
        global_step(engine, x, y, world, rank)
        norms.append(engine.get_global_grad_norm())  # padding counts: it must reduce as zeros
        kept.append([b.data_ptr() for b in bufs.pool.bases])
    named = dict(model.named_parameters())
    return {
        "params": {
            n: safe_get_full_fp32_param(p).clone() for n, p in named.items() if p.requires_grad
        },
        "kept": kept,
        "norms": norms,
        "world": world,
        "sizes": [b.numel() for b in bufs.pool.bases],
        "free": len(bufs.pool.free),
        "cap": bufs.cap,
        "pool_bytes": bufs.pool.nbytes(),
        "report": engine.memory_report(),
    }


def cases(offload: bool) -> dict:
    return {(s, p): train(s, p, offload) for s in (2, 3) for p in (False, True)}


def _check(results: dict) -> None:
    for (stage, poison), r in results.items():
        assert 1 <= len(r["sizes"]) <= 2 and max(r["sizes"]) <= r["cap"], (stage, r["sizes"])
        assert r["kept"][1] == r["kept"][2], stage  # the same buffers step after step
        assert r["free"] == len(r["sizes"])  # all back in the pool after the backward
        assert r["report"]["peak.device.reduce_buffers"] >= r["pool_bytes"] > 0
        clean = results[(stage, False)]["params"]
        assert all(torch.equal(r["params"][n], clean[n]) for n in clean), (stage, poison)
        _check_norms(r)


def _check_norms(r: dict) -> None:
    """Plain PyTorch's gradient norms on the same global batches."""
    _, _, grads, _ = reference(STEPS, r["world"], 1, MICRO, 0.5)
    want = [sum(float(g.double().square().sum()) for g in s.values()) ** 0.5 for s in grads]
    for got, w in zip(r["norms"], want):
        assert abs(got - w) <= 1e-5 * w, (got, w)


def test_reduce_pool_world1():
    _check(cases(offload=True))  # no device grad shard: the buckets reduce from the pool


def test_world1_fills_the_grad_shard_directly():
    """One rank with a device grad shard: the reduction is the identity, the hooks copy each
    gradient into the grad shard itself; no reduce buffer exists."""
    r = train(2, poison=False, offload=False)
    assert r["sizes"] == [] and r["report"]["peak.device.reduce_buffers"] == 0
    _check_norms(r)


def test_reduce_pool_world2():
    _check(run_ranks(2, cases, False))
