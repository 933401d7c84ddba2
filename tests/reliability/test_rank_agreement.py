"""Item: ranks start from rank 0's weights and must agree on config and shapes."""

from __future__ import annotations

import pytest
import torch
from distributed import run_ranks


def _seeded_by_rank(stage: int, offload: bool) -> dict:
    import reliability_helpers as h

    from zero_offload.core import dist

    rank = dist.rank()
    model = h.net(seed=100 + rank)  # each rank builds different initial weights
    model.running.fill_(float(rank))
    import zero_offload

    eng, _, _, _ = zero_offload.initialize(model=model, config=h.config(stage, offload))
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    start["running"] = model.running.clone()
    eng.backward(eng(h.batch(seed=rank)))
    eng.step()
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(after) for _ in range(dist.world_size())]
    torch.distributed.all_gather(gathered, after)
    starts = [None, None]
    torch.distributed.all_gather_object(starts, start)
    return {"starts": starts, "after": gathered, "rank0_init": h.net(seed=100).state_dict()}


PLACEMENTS = [(0, False), (2, False), (1, True)]


def _all_placements() -> list[dict]:
    return [_seeded_by_rank(stage, offload) for stage, offload in PLACEMENTS]


@pytest.fixture(scope="module")
def seeded_runs() -> list[dict]:
    return run_ranks(2, _all_placements)  # one spawn for every placement


@pytest.mark.parametrize("case", range(len(PLACEMENTS)), ids=[f"{s}-{o}" for s, o in PLACEMENTS])
def test_ranks_start_from_rank0_weights(seeded_runs, case):
    out = seeded_runs[case]
    s0, s1 = out["starts"]
    for name, t in s0.items():
        torch.testing.assert_close(s1[name], t, rtol=0, atol=0, msg=name)
    for name, t in out["rank0_init"].items():
        if name != "running":
            torch.testing.assert_close(s0[name], t, rtol=0, atol=0, msg=name)
    assert float(s1["running"][0]) == 0.0  # rank 0's buffer
    torch.testing.assert_close(out["after"][1], out["after"][0], rtol=0, atol=0)


def _mismatched(kind: str) -> str:
    import reliability_helpers as h

    import zero_offload
    from zero_offload.core import dist

    rank = dist.rank()
    cfg = h.config(stage=2)
    width = 8
    if kind == "bucket" and rank == 1:
        cfg["zero_optimization"]["reduce_bucket_size"] = 70
    if kind == "stage" and rank == 1:
        cfg["zero_optimization"]["stage"] = 1
    if kind == "shape" and rank == 1:
        width = 9
    if kind in OTHER_KEYS:  # keys that shape collectives or the update; rank 1 differs
        section, key, value = OTHER_KEYS[kind]
        if section == "zero_optimization":
            cfg["zero_optimization"]["stage"] = 3
        if rank == 1:
            (cfg.setdefault(section, {}) if section else cfg)[key] = value
    model = h.net(width=width)
    if kind == "leaf" and rank == 1:
        from zero_offload.utils import set_z3_leaf_module

        set_z3_leaf_module(model.a, True)
    try:
        zero_offload.initialize(model=model, config=cfg)
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return "no error"


# Before, the agreement skipped these: ranks that differed deadlocked until the timeout.
OTHER_KEYS = {
    "reuse": ("zero_optimization", "stage3_max_reuse_distance", 7),
    "model_persistence": ("zero_optimization", "stage3_model_persistence_threshold", 5),
    "allgather_partitions": ("zero_optimization", "allgather_partitions", False),
    "gather_on_save": ("zero_optimization", "stage3_gather_16bit_weights_on_model_save", True),
    "tag_validation": ("checkpoint", "tag_validation", "fail"),
    "overflows": (None, "max_consecutive_overflows", 3),
}
KINDS = {
    "bucket": "zero_optimization.reduce_bucket_size",
    "stage": "zero_optimization.stage",
    "shape": "param a.weight",
    "leaf": "zero-3 leaf modules",
    **{
        kind: f"{section}.{key}" if section else key
        for kind, (section, key, _) in OTHER_KEYS.items()
    },
}


def _all_mismatches() -> dict[str, str]:
    # Every rank raises after the same gather, so the ranks stay in step for the next case.
    return {kind: _mismatched(kind) for kind in KINDS}


@pytest.fixture(scope="module")
def mismatch_messages() -> dict[str, str]:
    return run_ranks(2, _all_mismatches)


@pytest.mark.parametrize("kind", list(KINDS))
def test_mismatched_ranks_name_the_key(mismatch_messages, kind):
    key = KINDS[kind]
    msg = mismatch_messages[kind]
    assert msg.startswith("RankMismatchError"), msg
    assert key in msg and "rank 1" in msg and "rank 0" in msg, msg
