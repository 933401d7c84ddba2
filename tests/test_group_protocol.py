"""The optimizer group's step protocol, one small test per step for each placement, written
against the group (no ``initialize()``, except the stage-3 ZenFlow kinds, whose group needs
the engine's param store): ``stage`` then ``rollback`` leaves the master, the moments, the step
count, the runner's own state and the params bitwise unchanged; ``stage`` then ``commit`` is
the update path's own synchronous step, bitwise."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
from components import feed, flat_group, placement, tiny_params

from zero_offload.config.zero.zenflow import ZenFlowConfig, resolve_schedule
from zero_offload.core.partitioned import shape_of
from zero_offload.core.state.format import StateFormat
from zero_offload.core.streams import Streams
from zero_offload.nvme.io.aio import AioEngine
from zero_offload.runtime.reduce.grad_shard import GradShard
from zero_offload.runtime.update.group import OptimizerGroup, build_shard_optimizer
from zero_offload.runtime.update.muon.momentum_state import MomentumState
from zero_offload.runtime.update.param_home import FlatHome
from zero_offload.runtime.update.paths.host_worker import HostWorker
from zero_offload.runtime.update.shard_optimizer import UpdatePolicy
from zero_offload.runtime.update.state_build import build_states
from zero_offload.runtime.update.zenflow.wiring import build_zenflow_update

CPU = torch.device("cpu")
# Each kind: the placement of its optimizer state.
WHERE = {
    "device": "device",
    "host": "host",
    "nvme": "nvme",
    "twin": "host",  # ratio 0.5: a device part and a host part
    "muon": "device",
    "host-muon": "host",
    "client": "device",
    "host-client": "host",
    "zenflow": "host",  # micro-step 1 is the device part alone (written in stage, undone)
    "zenflow-overlap": "host",
    "host-8bit": "host",  # a compact state kind: fp32 master, 8-bit moments
    "device-8bit": "device",  # the same on the device (the reference arithmetic)
    "twin-8bit": "host",  # ratio 0.5: two compact parts
    "zenflow-stage3": "host",  # the group of an engine (stage 3: params in the param store)
    "zenflow-overlap-stage3": "host",
}
KINDS = list(WHERE)
MUON = {"use_muon": True, "momentum": 0.95, "ns_method": "standard"}


def _params(kind: str) -> list[torch.nn.Parameter]:
    """``tiny_params``; Muon's are matrices (it orthogonalizes each param's update)."""
    if not kind.endswith("muon"):
        return tiny_params()
    g = torch.Generator().manual_seed(1)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(7, 5), (6, 4), (40, 60)]]


def _build(kind: str, tmp_path: Path) -> tuple[OptimizerGroup, list]:
    """A stage-2 group at world 1 of ``_params(kind)`` for one placement ``kind`` (a stage-3
    kind: the first group of a one-rank engine)."""
    if kind.endswith("stage3"):
        return _stage3_group(kind)
    params = _params(kind)
    muon = kind.endswith("muon")
    place = placement(WHERE[kind], tmp_path / kind)
    if kind.startswith("twin"):
        place = dataclasses.replace(place, ratio=0.5)
    if kind.endswith("8bit"):
        place = dataclasses.replace(place, state=StateFormat(moments="8bit", block=32))
    g = flat_group(params)
    if muon:
        g.hyper.update(MUON)
    client = torch.optim.SGD(params, lr=0.1, momentum=0.9) if kind.endswith("client") else None
    if client is not None:  # the engine's group hyperparameters are the client's
        g.hyper.update({k: v for k, v in client.param_groups[0].items() if k != "params"})
    adam = client is None and not muon
    streams = Streams(CPU)
    aio = AioEngine(place.nvme.aio) if place.nvme is not None else None
    (state,) = build_states([g], True, place, aio, adam)
    if muon:
        state = MomentumState(state)
    cut = place.host_from(g.shard_numel(True))
    grads = GradShard(g, 2, place.host_update, 1, streams, False, host_from=cut)
    home = FlatHome(g, streams, True, 1 << 20)
    policy = UpdatePolicy(True, True, place)
    if kind.startswith("zenflow"):
        so = _zenflow(kind, (g, grads, home, state, policy, streams))
    else:
        so = build_shard_optimizer(g, grads, home, state, policy, streams, client=client)
    return OptimizerGroup(g, grads, home, so, place), params


def _stage3_group(kind: str) -> tuple[OptimizerGroup, list]:
    """ZenFlow at stage 3 (every param partitioned, offload_optimizer "cpu") as ``_zenflow``
    builds it, through the engine: its first group, and the params (empty: partitioned)."""
    import zero_offload

    for k, v in {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "LOCAL_RANK": "0",
                 "WORLD_SIZE": "1", "MASTER_PORT": str(29500 + os.getpid() % 2000)}.items():  # fmt: skip
        os.environ.setdefault(k, v)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 4))
    zf = {"topk_ratio": 0.5, "select_strategy": "step", "select_interval": 0, "update_interval": 3,
          "full_warm_up_rounds": 0, "overlap_step": "overlap" in kind}  # fmt: skip
    cfg = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                 "stage3_param_persistence_threshold": 0, "zenflow": zf}}  # fmt: skip
    engine, *_ = zero_offload.initialize(model=model, config=cfg)
    og = engine.opt_groups[0]
    assert og.flat.flat is None and all(p.numel() == 0 for p in og.flat.params)  # partitioned
    return og, list(reversed(og.flat.params))  # registration order, as _params gives


def _zenflow(kind: str, args: tuple):
    """ZenFlow: columns chosen at micro-step 0, host updates after micro-steps 2, 5, ...; the
    overlapped kind runs them on a worker."""
    overlap = kind.endswith("overlap")
    cfg = ZenFlowConfig(topk_ratio=0.5, select_strategy="step", select_interval=0,
                        update_interval=3, full_warm_up_rounds=0, overlap_step=overlap)  # fmt: skip
    worker = HostWorker(CPU, 1) if overlap else None
    return build_zenflow_update(args, resolve_schedule(cfg, None), 0.0, lambda: 1.0, None, worker)


def _grads(params: list, step: int) -> list[torch.Tensor]:
    """One gradient per param, in flat order (reverse registration order)."""
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(shape_of(p), generator=g) for p in reversed(params)]


def _snapshot(og: OptimizerGroup, params: list) -> list[torch.Tensor]:
    """Master, moments, the update's own state (ZenFlow's accumulator, counters, columns and
    their moments) and params as they are now (copies)."""
    numel = og.state.numel
    out = [og.state.read(kind, 0, numel).clone() for kind in ("master", "exp_avg", "exp_avg_sq")]
    out += [t.clone() for _, t in sorted(og.optimizer.extra_state().items())]
    out.append(og.home.read(0, numel).clone())  # the params as the home holds them (stage 3)
    return out + [p.detach().clone() for p in params]


def _step(og: OptimizerGroup, params: list, t: int) -> None:
    feed(og, _grads(params, t))
    og.stage(0.5, t)
    og.commit()
    og.grads.zero()


@pytest.mark.parametrize("kind", KINDS)
def test_stage_then_rollback_changes_nothing(kind, tmp_path):
    og, params = _build(kind, tmp_path)
    _step(og, params, 0)  # a committed step first: the moments are not zero
    before, count = _snapshot(og, params), og.optimizer.step_count
    feed(og, _grads(params, 1))
    og.stage(0.5, 1)
    og.rollback()
    assert og.optimizer.step_count == count == 1
    for got, want in zip(_snapshot(og, params), before):
        assert torch.equal(got, want)


@pytest.mark.parametrize("kind", KINDS)
def test_stage_then_commit_is_the_step(kind, tmp_path):
    og, params = _build(kind, tmp_path / "a")
    ref, ref_params = _build(kind, tmp_path / "b")
    initial = og.home.read(0, og.state.numel).clone()
    for t in range(2):
        _step(og, params, t)
        feed(ref, _grads(ref_params, t))
        ref.optimizer.step(0.5)  # the update path's synchronous step, no protocol
        ref.grads.zero()
    assert og.optimizer.step_count == ref.optimizer.step_count == 2
    for got, want in zip(_snapshot(og, params), _snapshot(ref, ref_params)):
        assert torch.equal(got, want)
    assert not torch.equal(og.home.read(0, og.state.numel), initial)  # it did update


def test_commit_without_stage_does_nothing(tmp_path):
    og, params = _build("host", tmp_path)
    before = _snapshot(og, params)
    og.commit()
    assert og.optimizer.step_count == 0
    for got, want in zip(_snapshot(og, params), before):
        assert torch.equal(got, want)


def _device_bytes(og: OptimizerGroup) -> tuple[dict[str, int], dict[str, int]]:
    """The group's device buffers summed per category, and its report's device entries."""
    listed: dict[str, int] = {}
    for b in og.buffers():
        if b.category is not None:
            n = b.tensor.numel() * b.tensor.element_size()
            listed[b.category] = listed.get(b.category, 0) + n
    report = {k: v for k, v in og.nbytes().items() if k.startswith("device.") and v}
    return {k: v for k, v in listed.items() if v}, report


@pytest.mark.parametrize("kind", [k for k in KINDS if not k.endswith("client")])
def test_buffers_are_the_device_bytes_reported(kind, tmp_path):
    """What offload_states moves is what the memory report counts on the device (a client
    optimizer's state is moved but counted apart: not listed here)."""
    og, params = _build(kind, tmp_path)
    _step(og, params, 0)
    listed, report = _device_bytes(og)
    assert listed == report
    # ZenFlow's device part keeps its columns' moments on the device (the CPU here)
    assert bool(listed) == (WHERE[kind] == "device" or kind.startswith("twin") or "zenflow" in kind)
