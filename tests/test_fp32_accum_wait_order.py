"""Stages 0/1 with ``grad_accum_dtype: "fp32"`` and ``overlap_comm``: the reduce stream's wait on
the compute stream must be recorded *after* ``GradShard.bucket_input`` queued the bucket's
``accum.add_`` on the compute stream, or on CUDA the norm, clip, host copy and collective can
read ``accum`` before the add lands (silent). On the CPU every wait is a no-op, so the order of
the calls is recorded instead; tests/cuda_probes/ shows the values on a GPU."""

from __future__ import annotations

import pytest
from parity import batches, engine_config, make_model

import zero_offload
from zero_offload.core.streams import Streams
from zero_offload.runtime.reduce.grad_shard import GradShard
from zero_offload.runtime.reduce.reducer import Reducer


@pytest.mark.parametrize("stage", [0, 1])
def test_accum_add_is_queued_before_the_reduce_stream_waits(monkeypatch, stage):
    log: list[str] = []
    orig_input, orig_wait, orig_launch = GradShard.bucket_input, Streams.wait, Reducer._launch

    def launch(self, key):
        log.append("[")
        orig_launch(self, key)
        log.append("]")

    def bucket_input(self, b):
        log.append("add" if self.accum is not None else "input")
        return orig_input(self, b)

    def wait(self, waiter, waitee):
        if waitee is None:  # a side stream waiting on the compute stream
            log.append("wait")
        return orig_wait(self, waiter, waitee)

    monkeypatch.setattr(GradShard, "bucket_input", bucket_input)
    monkeypatch.setattr(Streams, "wait", wait)
    monkeypatch.setattr(Reducer, "_launch", launch)
    cfg = engine_config(stage, False, 2, 2, 0.0, overlap=True, dtype="bf16")
    cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    engine, *_ = zero_offload.initialize(model=make_model(), config=cfg)
    for x, y in batches(1, 1, 2, 2):
        for k in range(2):
            engine.backward(engine(x[2 * k : 2 * k + 2], y[2 * k : 2 * k + 2]))
            engine.step()
    engine.destroy()
    launches, cur = [], None
    for e in log:
        if e == "[":
            cur = []
        elif e == "]":
            launches.append(cur)
            cur = None
        elif cur is not None:
            cur.append(e)
    with_add = [calls for calls in launches if "add" in calls]
    assert with_add, "the fp32 accumulator path did not run"
    for calls in with_add:  # the add first, then the wait that guards the bucket's reduction
        assert calls[:2] == ["add", "wait"], calls
