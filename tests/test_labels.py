"""Profiler labels: each named range shows up in a torch.profiler run of the engine mode that has
that phase (on the CPU, and on CUDA where there is one), and without a profiler ``label`` is a
no-op context."""

from __future__ import annotations

import contextlib

import pytest
import torch
from parity import batches, engine_config, make_model
from torch.profiler import ProfilerActivity, profile

import zero_offload
from zero_offload.core import labels

# The CUDA case is marked ``cuda``: it runs with the GPU tests, never among the CPU tests (which
# see no GPU on a machine with one, tests/conftest.py).
CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


def _names_in_profiled_steps(cfg: dict, steps: int = 2) -> set[str]:
    engine, _, _, _ = zero_offload.initialize(model=make_model(), config=cfg)
    data = [(x.to(engine.device), y.to(engine.device)) for x, y in batches(steps + 1, 1, 1, 2)]
    x, y = data[0]
    engine.backward(engine(x, y))  # the first step outside the profiler (stage 3 records order)
    engine.step()
    activities = [ProfilerActivity.CPU]
    if engine.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for x, y in data[1:]:
            engine.backward(engine(x, y))
            engine.step()
        engine.flush_delayed_update()
    engine.destroy()
    return {e.name for e in prof.events()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "stage,offload_param,want",
    [
        (
            2,
            False,
            {labels.REDUCE, labels.GRAD_D2H, labels.HOST_UPDATE, labels.PARAM_H2D},
        ),
        (3, True, {labels.REDUCE, labels.GRAD_D2H, labels.HOST_UPDATE, labels.FETCH}),
    ],
)
def test_labels_appear_in_a_profiled_engine_run(monkeypatch, device, stage, offload_param, want):
    monkeypatch.setenv("ZERO_OFFLOAD_DEVICE", device)
    cfg = engine_config(
        stage=stage, offload=True, gas=1, micro=2, clip=1.0, overlap=False,
        offload_param=offload_param, pin_memory=device == "cuda",
    )  # fmt: skip
    names = _names_in_profiled_steps(cfg)
    if device == "cuda":  # the host waits on the copies' event; on the CPU there is none
        want = want | {labels.GRAD_WAIT}
    assert want <= names, sorted(n for n in names if n.startswith("zero_offload."))
    assert {n for n in names if n.startswith("zero_offload.")} <= set(labels.ALL)


def test_label_is_a_no_op_without_a_profiler():
    assert not torch.autograd.profiler._is_profiler_enabled
    assert isinstance(labels.label(labels.HOST_UPDATE), contextlib.nullcontext)
    with labels.label(labels.HOST_UPDATE):
        pass


def test_label_records_while_a_profiler_runs():
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with labels.label(labels.FETCH):
            torch.ones(3).sum()
    assert labels.FETCH in {e.name for e in prof.events()}
