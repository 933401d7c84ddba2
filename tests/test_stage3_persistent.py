"""Stage-3 persistent params (``stage3_param_persistence_threshold``) stay gathered between steps,
as DeepSpeed keeps them: after each step and after a checkpoint load, reading one through
``engine.module`` (no ``GatheredParameters``) gives the full, updated value, equal to plain
PyTorch AdamW's at that step; the other params stay released; training is bitwise the same as
with nothing persistent."""

from __future__ import annotations

import copy

import pytest
import torch
from distributed import every_rank
from parity import BETAS, EPS, LR, WD, batches, engine_config, make_model, reference_step

import zero_offload
from zero_offload.core.status import ZeroParamStatus

# Tiny's units: emb 512, l1 408, l2 400, frozen 272, norm 32, unused 12 elements
THRESHOLD = 400
PERSISTENT = {"l2.weight", "l2.bias", "frozen.weight", "frozen.bias", "norm.weight", "norm.bias",
              "unused.weight", "unused.bias"}  # fmt: skip
PLACEMENTS = [(False, False), (True, False), (True, True)]  # offload_optimizer, offload_param
STEPS, SAVED_AT = 3, 2


def _engine(offload: bool, offload_param: bool, threshold: int):
    cfg = engine_config(
        3, offload, 1, 2, 0.0, overlap=False, offload_param=offload_param,
        zero_extra={"stage3_param_persistence_threshold": threshold},
    )  # fmt: skip
    engine, *_ = zero_offload.initialize(model=make_model(), config=copy.deepcopy(cfg))
    return engine, engine.module


def _mismatches(model, ref, exact: bool = False) -> list[str]:
    """What differs from the expected state: a persistent param not full or not ``ref``'s value
    (a module, or a dict name -> tensor), or a non-persistent one gathered."""
    bad = []
    refs = dict(ref.named_parameters()) if isinstance(ref, torch.nn.Module) else ref
    for n, p in model.named_parameters():
        if n in PERSISTENT:
            full = p.ds_status is ZeroParamStatus.AVAILABLE and p.shape == refs[n].shape
            v, r = p.detach().cpu(), refs[n]
            if not full or not (torch.equal(v, r) if exact else torch.allclose(v, r, 1e-4, 1e-6)):
                bad.append(f"{n} {'stale' if full else tuple(p.shape)}")
        elif p.numel() != 0 or p.ds_status is not ZeroParamStatus.NOT_AVAILABLE:
            bad.append(f"{n} gathered")
    return bad


def _train(offload: bool, offload_param: bool, folder: str) -> dict:
    from zero_offload.core import dist

    world, rank = dist.world_size(), dist.rank()
    engine, model = _engine(offload, offload_param, THRESHOLD)
    got = {n for n, p in model.named_parameters() if p.ds_persist}
    assert got == PERSISTENT, got
    ref = make_model()
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR,
                            betas=BETAS, eps=EPS, weight_decay=WD)  # fmt: skip
    out: dict = {"steps": [], "losses": []}
    saved = None
    for k, (x, y) in enumerate(batches(STEPS, world, 1, 2), start=1):
        loss = engine(x[rank * 2 : rank * 2 + 2], y[rank * 2 : rank * 2 + 2])
        engine.backward(loss)
        engine.step()
        reference_step(ref, opt, x, y)
        out["losses"].append(float(loss.detach()))
        out["steps"].append(_mismatches(model, ref))
        if k == SAVED_AT:
            engine.save_checkpoint(folder, tag="t")
            saved = copy.deepcopy(ref)
    engine.load_checkpoint(folder, tag="t")
    out["loaded"] = _mismatches(model, saved)
    engine.destroy()
    fresh, model = _engine(offload, offload_param, THRESHOLD)  # a new engine's first load
    fresh.load_checkpoint(folder, tag="t")
    out["fresh_load"] = _mismatches(model, saved)
    fresh.destroy()
    # the same training with nothing persistent: the same losses, bit for bit
    plain, _ = _engine(offload, offload_param, 0)
    losses = []
    for x, y in batches(STEPS, world, 1, 2):
        loss = plain(x[rank * 2 : rank * 2 + 2], y[rank * 2 : rank * 2 + 2])
        plain.backward(loss)
        plain.step()
        losses.append(float(loss.detach()))
    plain.destroy()
    out["same_training"] = losses == out["losses"]
    return out


def _all_placements(root: str) -> list[dict]:
    return [_train(o, p, f"{root}/{o}-{p}") for o, p in PLACEMENTS]


@pytest.mark.parametrize("world", [1, 2])
def test_persistent_params_stay_gathered_and_current(tmp_path, world):
    if world == 1:
        ranks = [_all_placements(str(tmp_path))]
    else:
        ranks = every_rank(2, _all_placements, str(tmp_path))
    for results in ranks:
        for placement, r in zip(PLACEMENTS, results):
            assert r["steps"] == [[]] * STEPS, (placement, r["steps"])
            assert r["loaded"] == [], (placement, r["loaded"])
            assert r["fresh_load"] == [], (placement, r["fresh_load"])
            assert r["same_training"], placement


def _updates(extra: dict) -> list[list[str]]:
    """Per step (and after ``flush_delayed_update``), what differs from the same run with
    nothing persistent, whose params ``GatheredParameters`` gathers from the shards: the
    delayed update computes on params one step old, so plain AdamW is no reference there."""
    from zero_offload.core import dist

    world, rank = dist.world_size(), dist.rank()
    engines = []
    for threshold in (THRESHOLD, 0):
        cfg = engine_config(
            3, True, 1, 2, 0.0, overlap=False, offload_param=extra.get("offload_param", False),
            zero_extra={"stage3_param_persistence_threshold": threshold},
            **{k: v for k, v in extra.items() if k != "offload_param"},
        )  # fmt: skip
        engines.append(zero_offload.initialize(model=make_model(), config=cfg)[0])
    (engine, plain), out = engines, []

    def compare() -> list[str]:
        with zero_offload.zero.GatheredParameters(list(plain.module.parameters())):
            want = {n: p.detach().cpu().clone() for n, p in plain.module.named_parameters()}
        return _mismatches(engine.module, want, exact=True)

    for x, y in batches(STEPS, world, 1, 2):
        for e in engines:
            e.backward(e(x[rank * 2 : rank * 2 + 2], y[rank * 2 : rank * 2 + 2]))
            e.step()
        out.append(compare())
    for e in engines:
        e.flush_delayed_update()
    out.append(compare())
    for e in engines:
        e.destroy()
    return out


def _edits() -> dict:
    """A local fp32 setter and a ``GatheredParameters`` write-back on persistent params."""
    from zero_offload.utils import safe_get_local_fp32_param, safe_set_local_fp32_param

    engine, model = _engine(True, False, THRESHOLD)
    x = torch.randint(0, 32, (2, 5))
    engine.backward(engine(x, x))
    engine.step()
    norm, l2 = model.norm.weight, model.l2.bias
    want = norm.detach().clone() + 1.0
    safe_set_local_fp32_param(norm, safe_get_local_fp32_param(norm) + 1.0)
    out = {"setter": norm.shape == want.shape and torch.equal(norm.detach(), want)}
    with zero_offload.zero.GatheredParameters([l2], modifier_rank=0):
        if zero_offload.comm.get_rank() == 0:
            l2.data.fill_(2.0)
    out["write_back"] = l2.numel() > 0 and bool((l2.detach() == 2.0).all())
    engine.destroy()
    return out


EXTRAS = [{"delayed_update": True}, {"delayed_update": True, "offload_param": True},
          {"ratio": 0.5}]  # fmt: skip


def _updates_and_edits() -> dict:
    return {"updates": [_updates(dict(e)) for e in EXTRAS], "edits": _edits()}


def test_delayed_and_partial_updates_and_edits_keep_persistent_params_current():
    for r in every_rank(2, _updates_and_edits):
        for extra, steps in zip(EXTRAS, r["updates"]):
            assert steps == [[]] * (STEPS + 1), (extra, steps)
        assert r["edits"] == {"setter": True, "write_back": True}, r["edits"]
