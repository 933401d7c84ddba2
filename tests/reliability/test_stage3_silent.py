"""Issue: stage-3 edits and leftovers that used to pass silently.

A ``GatheredParameters`` block without ``modifier_rank`` discards edits, persistent params
included (before, a LayerNorm edit stayed in the next forward and backward, then was overwritten
from the master: a step on weights no rank owned, and different ones per rank)."""

from __future__ import annotations

import pytest
import torch
from distributed import every_rank
from parity import engine_config, make_model

import zero_offload
from zero_offload import zero


def _gathered(params) -> list[torch.Tensor]:
    with zero.GatheredParameters(params):
        return [p.detach().clone() for p in params]


def _edit_without_modifier(world: int) -> dict:
    model = make_model()
    cfg = engine_config(  # the norm's 32 elements persist, l1's 400 are partitioned
        3, False, 1, 2, 0.0, overlap=False, zero_extra={"stage3_param_persistence_threshold": 100}
    )
    engine, *_ = zero_offload.initialize(model=model, config=cfg)
    rank = zero_offload.comm.get_rank()
    x = torch.randint(0, 32, (2, 5))
    with torch.no_grad():
        before = float(engine(x, x))
    norm, big = model.norm.weight, model.l1.weight
    assert norm.ds_persist and not big.ds_persist and big.numel() == 0
    values = _gathered([norm, big])
    with zero.GatheredParameters([norm, big]):
        norm.data.mul_(5.0 + rank)  # a different edit per rank
        big.data.zero_()
    with torch.no_grad():
        after = float(engine(x, x))
    kept = [torch.equal(a, b) for a, b in zip(_gathered([norm, big]), values)]
    out = {"rank": rank, "before": before, "after": after, "kept": kept}
    out["norm_available"] = norm.numel() > 0
    out["big_released"] = big.numel() == 0
    engine.destroy()
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_edits_without_modifier_rank_are_discarded(world):
    ranks = [_edit_without_modifier(1)] if world == 1 else every_rank(2, _edit_without_modifier, 2)
    assert [r["rank"] for r in ranks] == list(range(world))
    for r in ranks:  # rank 1's edit (x6) is discarded as rank 0's (x5) is
        assert r["norm_available"] and r["big_released"], r  # the persistent param stays
        assert r["kept"] == [True, True], r  # ...gathered, with its own value, not the edit
        assert r["after"] == r["before"], r
    assert len({r["after"] for r in ranks}) == 1  # every rank computes with the same weights


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("how", ["unfrozen", "created"])
def test_a_param_the_engine_cannot_train_stops_the_step(stage, how):
    from zero_offload.runtime.engine.guards import EngineUsageError

    model = make_model()
    cfg = engine_config(stage, False, 1, 2, 0.0, overlap=False)
    engine, *_ = zero_offload.initialize(model=model, config=cfg)
    if how == "unfrozen":
        if stage == 3:  # a frozen param is partitioned too: unfreezing it is the same mistake
            assert model.frozen.weight.numel() == 0
        model.frozen.weight.requires_grad_(True)
    else:
        model.extra = torch.nn.Linear(2, 2)
    x = torch.randint(0, 32, (2, 5))
    engine.backward(engine(x, x))
    name = "frozen.weight" if how == "unfrozen" else "extra.weight"
    with pytest.raises(EngineUsageError, match=f"'{name}' requires grad but this engine"):
        engine.step()


def test_a_subset_in_model_parameters_is_allowed():
    model = make_model()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = engine_config(2, False, 1, 2, 0.0, overlap=False)
    engine, *_ = zero_offload.initialize(
        model=model, model_parameters=list(model.l1.parameters()), config=cfg
    )
    x = torch.randint(0, 32, (2, 5))
    engine.backward(engine(x, x))
    engine.step()  # the other trainable params were left out on purpose
    for n, p in model.named_parameters():  # only the params given were trained
        assert torch.equal(p, initial[n]) != n.startswith("l1."), n
