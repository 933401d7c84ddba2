"""fp32 params with the optimizer on the device alias the master to the flat buffer; at stages
1/2 on several ranks with several buckets the rank's master is one slice per bucket (no single
tensor), and a checkpoint still saves and restores it."""

from __future__ import annotations

import torch
from distributed import run_ranks
from parity import batches, engine_config, global_step, make_model

import zero_offload


def _run(root: str) -> tuple[dict, dict]:
    from zero_offload.core import dist
    from zero_offload.utils import safe_get_full_fp32_param

    world, rank = dist.world_size(), dist.rank()
    cfg = engine_config(2, False, 1, 2, 0.0, False)  # buckets of 100 elements: several
    steps = batches(2, world, 1, 2)
    engine = zero_offload.initialize(model=make_model(), config=cfg)[0]
    assert engine.opt_groups[0].optimizer.aliased and engine.opt_groups[0].state.master is None
    global_step(engine, *steps[0], world, rank)
    engine.save_checkpoint(root, tag="t")
    global_step(engine, *steps[1], world, rank)
    fresh = zero_offload.initialize(model=make_model(), config=cfg)[0]
    fresh.load_checkpoint(root, tag="t")
    global_step(fresh, *steps[1], world, rank)

    def full(e):
        named = e.module.named_parameters()
        return {n: safe_get_full_fp32_param(p).clone() for n, p in named if p.requires_grad}

    return full(engine), full(fresh)


def test_aliased_master_of_several_slices_saves_and_resumes(tmp_path) -> None:
    straight, resumed = run_ranks(2, _run, str(tmp_path))
    for n in straight:
        assert torch.equal(straight[n], resumed[n]), n
