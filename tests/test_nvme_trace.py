"""ZERO_OFFLOAD_NVME_TRACE: the opt-in timeline of the NVMe I/O (``nvme/io/trace.py``) records
every request of a stage-3 step with both states on NVMe, with the engine's phase marks, and
``trace_report`` reads the disk's busy time and bytes per phase off it."""

from __future__ import annotations

import torch

import zero_offload
from zero_offload.nvme.io import trace
from zero_offload.nvme.io.trace_report import load, phases, steps, table


def _engine(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(3)])
    (tmp_path / "swap").mkdir()
    block = {"device": "nvme", "nvme_path": str(tmp_path / "swap")}
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "sub_group_size": 2048,
            "offload_optimizer": dict(block),
            "offload_param": dict(block),
        },
        "steps_per_print": 10**9,
    }
    engine, *_ = zero_offload.initialize(model=model, config=cfg)
    assert all(p.numel() == 0 < p.ds_numel for p in engine.module.parameters())
    return engine


def test_trace_records_every_request_and_the_phases(tmp_path, monkeypatch):
    out = tmp_path / "io.jsonl"
    monkeypatch.setenv(trace.ENV, str(out))
    monkeypatch.setattr(trace, "_read", False)
    monkeypatch.setattr(trace, "_trace", None)
    engine = _engine(tmp_path)
    x = torch.randn(2, 64)
    for _ in range(2):
        engine.backward(engine(x).square().mean())
        engine.step()
    t = trace.tracer()
    assert t is not None
    t._stop = True
    t.dump()
    engine.destroy()
    events = load(out)
    requests = [e for e in events if "op" in e]
    assert {e["file"] for e in requests} == {"optimizer/group0.swp", "param/group0.swp"}
    assert all(e["done"] is not None and e["done"] >= e["submit"] for e in requests)
    found = steps(phases(events))
    assert [[p.name for p in s] for s in found] == [["forward", "backward", "step", "step_end"]] * 2
    state = engine.opt_groups[0].optimizer.state
    for s in found:
        step = s[2]
        # every record of the state written once per step, inside step()
        assert step.write_bytes >= state.nchunks * state.record
        assert 0 < step.busy <= step.wall and step.longest_gap <= step.wall
        # the backward reads the first records ahead
        assert s[1].read_bytes >= min(state.nchunks, len(state.pool)) * state.record
    assert "disk busy" in table(phases(events))


def test_without_the_variable_nothing_is_recorded(monkeypatch):
    monkeypatch.delenv(trace.ENV, raising=False)
    monkeypatch.setattr(trace, "_read", False)
    monkeypatch.setattr(trace, "_trace", None)
    assert trace.tracer() is None
    trace.mark("forward")  # a no-op


def test_each_rank_writes_its_own_file(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert trace._per_rank(tmp_path / "io.jsonl") == tmp_path / "io.jsonl.rank1"
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert trace._per_rank(tmp_path / "io.jsonl") == tmp_path / "io.jsonl"
