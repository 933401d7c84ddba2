"""The overlap analysis of benchmarks/_trace.py: interval arithmetic, event classes, and per-step
summaries of synthetic Chrome traces worked out by hand; then a real CPU profiler trace of a tiny
engine run (host ranges only: no GPU) and the delayed update's thread spans."""

from __future__ import annotations

import gzip
import json
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import _overlap_worker as worker  # noqa: E402
import _trace as tr  # noqa: E402


# ---- intervals ----------------------------------------------------------------------------------
def test_union_merges_overlapping_and_touching_and_drops_empty():
    got = tr.union([(5, 6), (0, 2), (1, 3), (6, 7), (8, 8), (9, 8)])
    assert got == [(0, 3), (5, 7)]
    assert tr.total(got) == 5


def test_intersect_and_clip():
    a = [(0, 3), (5, 7)]
    assert tr.intersect(a, [(2, 6)]) == [(2, 3), (5, 6)]
    assert tr.intersect(a, [(3, 5)]) == []
    assert tr.intersect([(0, 10)], [(1, 2), (3, 4), (9, 12)]) == [(1, 2), (3, 4), (9, 10)]
    assert tr.clip(a, 1, 6) == [(1, 3), (5, 6)]
    assert tr.clip(a, 4, 4) == []


# ---- classes ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "event,cls",
    [
        ({"cat": "kernel", "name": "sm90_xmma_gemm_bf16bf16_bf16f32"}, "compute"),
        ({"cat": "kernel", "name": "ncclDevKernel_AllGather_RING_LL(...)"}, "collective"),
        ({"cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)"}, "h2d"),
        ({"cat": "gpu_memcpy", "name": "Memcpy HtoD (Pageable -> Device)"}, "h2d"),
        ({"cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)"}, "d2h"),
        ({"cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)"}, "d2d"),
        ({"cat": "gpu_memset", "name": "Memset (Device)"}, None),
        ({"cat": "user_annotation", "name": "zero_offload.host_update"}, "host_update"),
        ({"cat": "user_annotation", "name": "zero_offload.fetch"}, "fetch"),
        ({"cat": "gpu_user_annotation", "name": "zero_offload.fetch"}, None),
        ({"cat": "user_annotation", "name": "bench.step"}, "bench.step"),
        ({"cat": "gpu_user_annotation", "name": "bench.step"}, None),
        ({"cat": "user_annotation", "name": "bench.backward"}, "bench.backward"),
        ({"cat": "user_annotation", "name": "ProfilerStep#3"}, None),
        ({"cat": "cpu_op", "name": "aten::mm"}, None),
        ({"cat": "cuda_runtime", "name": "cudaMemcpyAsync"}, None),
    ],
)
def test_classify(event, cls):
    assert tr.classify({"ph": "X", "ts": 0, "dur": 1, **event}) == cls


def test_classify_skips_non_complete_events():
    assert tr.classify({"ph": "s", "cat": "ac2g", "name": "zero_offload.fetch", "ts": 0}) is None
    assert tr.classify({"ph": "i", "cat": "kernel", "name": "k", "ts": 0}) is None


# ---- a synthetic trace --------------------------------------------------------------------------
def X(cat, name, ts, dur, tid=1, **args):  # noqa: N802
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid,
            "args": args}  # fmt: skip


COPY_NAMES = {"h2d": "Memcpy HtoD (Pinned -> Device)", "d2h": "Memcpy DtoH (Device -> Pinned)"}


def copy(kind, ts, dur, nbytes, correlation=None):
    args = (
        {"bytes": nbytes} if correlation is None else {"bytes": nbytes, "correlation": correlation}
    )
    return X("gpu_memcpy", COPY_NAMES[kind], ts, dur, tid=9 if kind == "d2h" else 10, **args)


def synthetic() -> list[dict]:
    """Step 1 in [0, 100] us (phases forward [0, 30], backward [30, 70], optimizer [70, 100]);
    step 2 in [200, 300] with one kernel over all of it. Host thread 1, autograd thread 2,
    GPU streams 7 and 8. 10,000 bytes in 10 us is 1 GB/s."""
    ua = "user_annotation"
    return [
        X(ua, "bench.step", 0, 100),
        X("gpu_user_annotation", "bench.step", 1, 120, tid=7),  # GPU-side copy: not a window
        X(ua, "ProfilerStep#1", 0, 100),
        X(ua, "bench.forward", 0, 30),
        X(ua, "bench.backward", 30, 40),
        X(ua, "bench.optimizer", 70, 30),
        # compute: [0, 25], [30, 60] + [50, 62] (another stream), [65, 70] -> union 62 us
        X("kernel", "gemm", 0, 25, tid=7),
        X("kernel", "gemm", 30, 30, tid=7),
        X("kernel", "gemm", 50, 12, tid=8),
        X("kernel", "gemm", 65, 5, tid=7),
        # D2H in backward: [40, 50] (issued by grad_d2h on thread 2), [60, 70] (unlabelled)
        copy("d2h", 40, 10, 10_000, correlation=11),
        copy("d2h", 60, 10, 10_000, correlation=12),
        X(ua, "zero_offload.grad_d2h", 34, 2, tid=2),
        X("cuda_runtime", "cudaMemcpyAsync", 35, 0.5, tid=2, correlation=11),
        X("cuda_runtime", "cudaMemcpyAsync", 55, 0.5, tid=2, correlation=12),
        # host update on thread 1: [72, 80], [82, 90] -> 16 us
        X(ua, "zero_offload.host_update", 72, 8),
        X(ua, "zero_offload.host_update", 82, 8),
        X(ua, "zero_offload.param_h2d", 79, 0.5),
        # H2D: [78, 84] (param_h2d), [88, 95] (issued inside host_update), [98, 104] straddles
        # the step's end: 2 of its 6 us are inside, so 2,000 of its 6,000 bytes count.
        copy("h2d", 78, 6, 6_000, correlation=13),
        X("cuda_runtime", "cudaMemcpyAsync", 79.2, 0.1, tid=1, correlation=13),
        copy("h2d", 88, 7, 7_000, correlation=14),
        X("cuda_runtime", "cudaMemcpyAsync", 89.9, 0.05, tid=1, correlation=14),
        copy("h2d", 98, 6, 6_000),
        {"ph": "s", "cat": "ac2g", "name": "flow", "ts": 35, "id": 11, "pid": 0, "tid": 2},
        # step 2
        X(ua, "bench.step", 200, 100),
        X("kernel", "gemm", 200, 100, tid=7),
    ]


def test_summary_of_a_synthetic_trace_by_hand():
    s = tr.summarize(synthetic())
    assert s["has_gpu"]
    assert len(s["steps"]) == 2
    one, two = s["steps"]
    assert one["window_ms"] == pytest.approx(0.1)
    assert one["phase_ms"] == pytest.approx(
        {"bench.forward": 0.03, "bench.backward": 0.04, "bench.optimizer": 0.03}
    )
    busy = one["busy_frac"]
    assert busy["compute"] == pytest.approx(0.62)
    assert busy["d2h"] == pytest.approx(0.20)
    assert busy["h2d"] == pytest.approx(0.15)  # 6 + 7 + 2 us
    assert busy["host_update"] == pytest.approx(0.16)
    assert one["busy_ms"]["compute"] == pytest.approx(0.062)
    ov = one["overlap"]
    # D2H in backward: [40, 50] all under compute [30, 62]; [60, 70]: [60, 62] and [65, 70]
    assert ov["d2h_compute_backward"] == pytest.approx(17 / 20)
    # H2D under host update: [78, 80] + [82, 84] + [88, 90] = 6 of 15 us
    assert ov["h2d_host_update"] == pytest.approx(6 / 15)
    assert ov["h2d_compute"] == pytest.approx(0.0)
    assert ov["host_update_compute"] == pytest.approx(0.0)
    assert one["overlap_ms"]["d2h_compute_backward"] == pytest.approx(0.017)
    assert one["bytes"] == pytest.approx({"h2d": 15_000, "d2h": 20_000})
    assert one["gbps"] == pytest.approx({"h2d": 1.0, "d2h": 1.0})
    assert one["bytes_by_issuer"]["d2h"] == pytest.approx(
        {"zero_offload.grad_d2h": 10_000, "-": 10_000}
    )
    assert one["bytes_by_issuer"]["h2d"] == pytest.approx(
        {"zero_offload.param_h2d": 6_000, "zero_offload.host_update": 7_000, "-": 2_000}
    )
    # step 2: one kernel over the whole window, nothing else
    assert two["busy_frac"]["compute"] == pytest.approx(1.0)
    assert two["busy_frac"]["h2d"] == 0.0
    assert two["overlap"]["d2h_compute_backward"] is None  # no backward phase, no D2H
    assert two["bytes"] == {}
    # medians over the two steps
    m = s["median"]
    assert m["busy_frac"]["compute"] == pytest.approx((0.62 + 1.0) / 2)
    assert m["overlap"]["d2h_compute_backward"] == pytest.approx(17 / 20)  # step 2 has none
    assert m["gbps"]["h2d"] == pytest.approx(1.0)
    assert s["copy_names"] == {
        "Memcpy DtoH (Device -> Pinned)": 2,
        "Memcpy HtoD (Pinned -> Device)": 3,
    }
    assert s["categories"]["kernel"] == 5


def test_copies_without_bytes_give_no_rate():
    events = [
        X("user_annotation", "bench.step", 0, 10),
        X("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 1, 2),
    ]
    one = tr.summarize(events)["steps"][0]
    assert one["busy_frac"]["h2d"] == pytest.approx(0.2)
    assert one["bytes"] == {"h2d": None}
    assert one["gbps"] == {"h2d": None}


def test_issuer_is_the_innermost_range_even_when_a_parent_starts_together():
    ua = "user_annotation"
    events = [
        X(ua, "bench.step", 0, 100),
        X(ua, "zero_offload.param_h2d", 50, 5),  # listed before its parent, same start
        X(ua, "bench.optimizer", 50, 50),
        X("cuda_runtime", "cudaMemcpyAsync", 52, 1, correlation=1),
        X("cuda_runtime", "cudaMemcpyAsync", 60, 1, correlation=2),
        X("cuda_runtime", "cudaMemcpyAsync", 61, 1, tid=5, correlation=3),  # another thread
        copy("h2d", 53, 1, 100, correlation=1),
        copy("h2d", 62, 1, 200, correlation=2),
        copy("h2d", 64, 1, 400, correlation=3),
    ]
    one = tr.summarize(events)["steps"][0]
    assert one["bytes_by_issuer"]["h2d"] == {
        "zero_offload.param_h2d": 100,
        "bench.optimizer": 200,
        "-": 400,
    }


def test_load_reads_plain_and_gzipped_traces(tmp_path):
    data = {"traceEvents": synthetic(), "displayTimeUnit": "ms"}
    plain, packed = tmp_path / "t.json", tmp_path / "t.json.gz"
    plain.write_text(json.dumps(data))
    with gzip.open(packed, "wt") as f:
        json.dump(data, f)
    assert tr.load(plain) == tr.load(packed) == json.loads(json.dumps(synthetic()))


def test_label_names_match_the_runtime():
    from zero_offload.core import labels

    assert tr.HOST_UPDATE == labels.HOST_UPDATE
    assert all(n.startswith(tr.LABEL_PREFIX) for n in labels.ALL)


# ---- the delayed update's thread spans ----------------------------------------------------------
def test_clock_offset_and_span_events():
    # trace ts = perf us + 1000: marks at 5 and 9 ms perf, step starts at 6000 and 10000 us
    off = worker.clock_offset_us([10_000.0, 6_000.0], [1, 5_000_000, 9_000_000])
    assert off == pytest.approx(1000.0)
    assert worker.clock_offset_us([], [1]) is None
    evs = worker.span_events([(42, 2_000_000, 2_500_000)], off, 7, tr.HOST_UPDATE)
    assert evs[0]["ts"] == pytest.approx(3000.0) and evs[0]["dur"] == pytest.approx(500.0)
    assert evs[0]["tid"] == 42 and tr.classify(evs[0]) == "host_update"


def test_span_executor_times_tasks_on_the_worker_thread():
    import concurrent.futures

    inner = concurrent.futures.ThreadPoolExecutor(1)
    rec = worker.SpanExecutor(inner)
    assert rec.submit(lambda a, b=0: a + b, 1, b=2).result() == 3
    fut = rec.submit(time.sleep, 0.01)
    fut.result()
    rec.shutdown()
    assert len(rec.spans) == 2
    tid, t0, t1 = rec.spans[1]
    assert tid != threading.get_native_id() and t1 - t0 >= 9_000_000


# ---- a real CPU profiler trace ------------------------------------------------------------------
@pytest.mark.parametrize("delayed", [False, True])
def test_cpu_profiler_trace_of_a_tiny_engine_run(tmp_path, monkeypatch, delayed):
    monkeypatch.setenv("ZERO_OFFLOAD_DEVICE", "cpu")  # the CPU even where there is a GPU
    import torch
    from parity import batches, engine_config, make_model
    from torch.profiler import ProfilerActivity, profile

    import zero_offload

    cfg = engine_config(
        stage=2, offload=True, gas=1, micro=2, clip=1.0, overlap=False, delayed_update=delayed
    )
    engine, _, _, _ = zero_offload.initialize(model=make_model(), config=cfg)
    rec = worker.time_host_update_thread(engine)
    assert (rec is not None) == delayed
    data, marks = batches(4, 1, 1, 2), []
    worker.train_step(engine, *data[0], lambda: None, marks)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for x, y in data[1:]:
            worker.train_step(engine, x, y, lambda: None, marks)
    engine.flush_delayed_update()
    engine.destroy()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    events = tr.load(path)
    if delayed:  # the worker thread's passes are not in the trace: add the timed spans
        assert "host_update" not in tr.Trace(events).unions
        off = worker.clock_offset_us([lo for lo, _ in tr.Trace(events).steps], marks)
        assert off is not None and rec.spans
        added = worker.span_events(rec.spans, off, 0, tr.HOST_UPDATE)
        assert len(added) == len(rec.spans)
        for ev, (tid, t0, t1) in zip(added, rec.spans):  # on the trace's clock, on its thread
            assert ev["tid"] == tid and tr.classify(ev) == "host_update"
            assert ev["ts"] == pytest.approx(t0 / 1e3 + off)
            assert ev["dur"] == pytest.approx((t1 - t0) / 1e3)
        events += added
    s = tr.summarize(events)
    assert not s["has_gpu"]
    assert len(s["steps"]) == 3
    assert {"host_update", "reduce", "grad_d2h", "param_h2d"} <= set(s["classes"])
    for step in s["steps"]:
        assert step["window_ms"] > 0
        assert set(step["phase_ms"]) == {"bench.forward", "bench.backward", "bench.optimizer"}
        for v in step["busy_frac"].values():
            assert 0.0 <= v <= 1.0
    host = [step["busy_frac"].get("host_update", 0.0) for step in s["steps"]]
    # Without the delayed update a pass runs inside every step's optimizer phase, on the main
    # thread. With it a pass runs whenever the worker thread gets the GIL: in a step, or in the
    # gap between two (seen under load), so no step is sure to hold one.
    if not delayed:
        assert min(host) > 0, host
    assert torch.autograd.profiler._is_profiler_enabled is False
