"""ZenFlow's per-micro-step traffic does not grow with the number of params: the device part's
values and gradient cross between host and device in one batched copy each (``transfer_all``),
the stage-3 positions are int32 and built from the selected elements only, and the overlapped
update's params go up through the staging buffer it allocates (asynchronously on a GPU)."""

from __future__ import annotations

import pytest
import torch
from zenflow_run import TOPK, batches, config

import zero_offload
from zero_offload.runtime.update.zenflow import update as update_mod
from zero_offload.runtime.update.zenflow import values as values_mod

pytestmark = pytest.mark.usefixtures("one_rank")


def _deep(width: int = 8, depth: int = 6) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, width)]
    for _ in range(depth):
        layers += [torch.nn.Tanh(), torch.nn.Linear(width, width)]
    layers += [torch.nn.Tanh(), torch.nn.Linear(width, 4)]
    return torch.nn.Sequential(*layers)


def _engine(model, zf, **kw):
    cfg = config(zf, **kw)
    if kw.get("stage") == 3:
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    engine, *_ = zero_offload.initialize(
        model=model, model_parameters=model.parameters(), config=cfg
    )
    return engine


def _step(engine, batch):
    x, y = batch
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()


@pytest.mark.parametrize("stage", [2, 3])
def test_one_batched_copy_per_direction_per_micro_step(stage, monkeypatch):
    """Every host-device copy of the device part goes through ``transfer_all``, called a fixed
    number of times per micro-step whatever the number of params (16 here)."""
    calls = []

    def counted(ts, device):
        calls.append(len(ts))
        return transfer(ts, device)

    transfer = values_mod.transfer_all
    monkeypatch.setattr(values_mod, "transfer_all", counted)
    monkeypatch.setattr(update_mod, "transfer_all", counted)
    engine = _engine(_deep(), {**TOPK, "select_interval": 4}, stage=stage)
    n = len(list(engine.module.parameters()))
    assert n >= 16
    for b in batches(3):
        before = len(calls)
        _step(engine, b)
        per_step = len(calls) - before
        assert 1 <= per_step <= 4, per_step  # gradient (twice at stage 3: a no-op), values in, out
    engine.destroy()


def test_stage3_positions_are_int32_and_counted_so():
    engine = _engine(_deep(16, 2), TOPK, stage=3)
    for b in batches(2):
        _step(engine, b)
    values = engine.opt_groups[0].optimizer.runner.values
    assert all(ix.dtype == torch.int32 for ix in values.index)
    held = sum(ix.numel() for ix in values.index)
    assert engine.memory_report()["host.zenflow_index"] == held * 4
    engine.destroy()


def test_stage3_positions_are_the_selected_elements_in_row_major_order():
    """The positions built from the selected columns equal the element-by-element rule."""
    engine = _engine(_deep(16, 2), TOPK, stage=3)
    _step(engine, batches(1)[0])
    zf = engine.opt_groups[0].optimizer.runner
    for i, c in enumerate(zf.columns):
        if c.columns is None:
            continue
        ncols = zf.shapes[i][-1]
        mask = torch.zeros(ncols, dtype=torch.bool)
        mask[c.columns] = True
        want = torch.cat(
            [
                torch.arange(at, at + n)[mask[torch.arange(at, at + n) % ncols]] + (sh - at)
                for at, sh, n in zf.pieces[i]
            ]  # fmt: skip
        )
        assert torch.equal(zf.values.index[i].long(), want)
    engine.destroy()


def test_the_overlapped_update_uploads_through_its_staging(monkeypatch):
    engine = _engine(_deep(), {**TOPK, "overlap_step": True}, dtype="bf16")
    zf = engine.opt_groups[0].optimizer
    assert zf.staging.kind == "whole"
    buf = zf.staging.buffer
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel() * 2
    sources = []
    real = zf.home.write

    def write(at, src, non_blocking=False):
        sources.append(lo <= src.data_ptr() < hi)
        real(at, src, non_blocking)

    monkeypatch.setattr(zf.home, "write", write)
    for b in batches(6):
        x, y = b
        engine.backward(torch.nn.functional.mse_loss(engine(x.bfloat16()).float(), y))
        engine.step()
    assert sources and all(sources)
    engine.destroy()
