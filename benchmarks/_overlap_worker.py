"""One mode of the overlap benchmark, in a process of its own (fresh memory; a CUDA error in one
mode cannot poison the next).

Usage (by ``overlap_trace.py``): ``python _overlap_worker.py SPEC_JSON OUT_JSON``. The spec holds
the model shape, the run (stage, offloads, dtype), the step counts, the trace path and
``overlap_comm``. The worker builds the GPT-2 and the engine, runs warm-up steps, times steps
without the profiler, then profiles a few with torch.profiler (CPU, plus CUDA on a GPU), writes
the Chrome trace gzipped, and writes the trace's overlap summary (``_trace.summarize``) with the
step times to OUT_JSON.

Every step is the range ``bench.step`` holding ``bench.forward``, ``bench.backward`` and
``bench.optimizer``; each phase ends with a device synchronize inside its range, so a phase's GPU
work lies inside its host range. The delayed update's host pass runs on a worker thread that
torch.profiler does not record: its spans are timed here and added to the trace as
``zero_offload.host_update`` ranges on that thread.
"""

from __future__ import annotations

import concurrent.futures
import gzip
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "src")]  # the checkout's package, not an install

STEP, FORWARD, BACKWARD, OPTIMIZER = (
    "bench.step",
    "bench.forward",
    "bench.backward",
    "bench.optimizer",
)
SPAN_SOURCE = "overlap_trace: host-update thread span"


class SpanExecutor(concurrent.futures.Executor):
    """The engine's host-update executor, timing every task it runs: (native thread id, start ns,
    end ns) on ``time.perf_counter_ns``'s clock."""

    def __init__(self, inner) -> None:
        """``inner``: the engine's ``HostWorker`` (its kernel thread count is this one's)."""
        self.inner = inner
        self.threads = getattr(inner, "threads", None)  # a HostWorker's; None: the default
        self.spans: list[tuple[int, int, int]] = []

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        def timed():
            t0 = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spans.append((threading.get_native_id(), t0, time.perf_counter_ns()))

        return self.inner.submit(timed)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.inner.shutdown(wait, cancel_futures=cancel_futures)


def time_host_update_thread(engine) -> SpanExecutor | None:
    """Route the engine's delayed host passes through a timing executor (None: no worker)."""
    rec = None
    for runner in (og.optimizer.runner for og in engine.opt_groups):
        worker = getattr(runner, "worker", None)  # the delayed runner's (ZenFlow's overlap's)
        if worker is not None:
            rec = rec or SpanExecutor(worker)
            runner.worker = rec
    return rec


def span_events(
    spans: list[tuple[int, int, int]], offset_us: float, pid: int, name: str
) -> list[dict[str, Any]]:
    """Chrome trace events for spans timed on perf_counter_ns; trace ts = perf us + offset_us."""
    return [
        {
            "ph": "X",
            "cat": "user_annotation",
            "name": name,
            "pid": pid,
            "tid": tid,
            "ts": t0 / 1e3 + offset_us,
            "dur": (t1 - t0) / 1e3,
            "args": {"source": SPAN_SOURCE},
        }
        for tid, t0, t1 in spans
    ]


def clock_offset_us(step_starts_us: list[float], marks_ns: list[int]) -> float | None:
    """trace ts - perf_counter us, from the profiled steps' ``bench.step`` starts in the trace and
    the perf_counter_ns read just inside each of them (the last ``len(step_starts_us)`` marks)."""
    n = len(step_starts_us)
    if n == 0 or len(marks_ns) < n:
        return None
    pairs = zip(sorted(step_starts_us), marks_ns[-n:])
    return statistics.median(ts - m / 1e3 for ts, m in pairs)


def train_step(engine, x, y, sync: Callable[[], None], marks: list[int]) -> Any:
    """One step in the benchmark's ranges; each phase synchronizes the device before it ends."""
    from torch.profiler import record_function

    with record_function(STEP):
        marks.append(time.perf_counter_ns())
        with record_function(FORWARD):
            loss = engine(x, y)
            sync()
        with record_function(BACKWARD):
            engine.backward(loss)
            sync()
        with record_function(OPTIMIZER):
            engine.step()
            sync()
    return loss


def build(spec: dict[str, Any]) -> tuple[Any, list, int]:
    """The engine over the spec's GPT-2, two token batches on its device, the param count."""
    import torch
    from _spec import ds_config, from_json

    import zero_offload
    from zero_offload.models.gpt2 import GPT2Config, GPT2Model, num_parameters, param_groups

    shape, run = from_json(spec)
    cfg = GPT2Config(
        num_layers=shape.layers,
        hidden_size=shape.hidden,
        num_attention_heads=shape.heads,
        seq_length=shape.seq,
        checkpoint_activations=spec["checkpoint_activations"],
    )
    torch.manual_seed(shape.seed)
    model = GPT2Model(cfg)
    config = ds_config(shape, run)
    config["zero_optimization"]["overlap_comm"] = spec["overlap_comm"]
    if run.offload:
        config["zero_optimization"]["offload_optimizer"]["threads"] = torch.get_num_threads()
    engine, _, _, _ = zero_offload.initialize(
        model=model, model_parameters=param_groups(model), config=config
    )
    g = torch.Generator().manual_seed(shape.seed + 1)
    tok = torch.randint(0, cfg.vocab_size, (2, shape.micro, shape.seq + 1), generator=g)
    batches = [(t[:, :-1].to(engine.device), t[:, 1:].to(engine.device)) for t in tok]
    return engine, batches, num_parameters(cfg)


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from _trace import HOST_UPDATE, Trace, summarize
    from torch.profiler import ProfilerActivity, profile, schedule

    engine, batches, n_params = build(spec)
    cuda = engine.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rec = time_host_update_thread(engine)
    marks: list[int] = []
    losses: list[float] = []
    k = 0

    def one_step() -> None:
        nonlocal k
        x, y = batches[k % len(batches)]
        k += 1
        losses.append(float(train_step(engine, x, y, sync, marks)))

    for _ in range(spec["warmup"]):
        one_step()
    step_ms = []
    for _ in range(spec["steps"]):
        t0 = time.perf_counter()
        one_step()
        step_ms.append((time.perf_counter() - t0) * 1e3)

    trace_json = Path(spec["trace"]).with_suffix("")  # .json.gz -> .json (removed below)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    n_prof = spec["profile_steps"]
    if rec is not None:
        rec.spans.clear()
    with profile(
        activities=activities,
        schedule=schedule(wait=0, warmup=1, active=n_prof, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(str(trace_json)),
    ) as prof:
        for _ in range(1 + n_prof):
            one_step()
            prof.step()
    sync()

    data = json.loads(trace_json.read_text())
    events = data["traceEvents"]
    offset = clock_offset_us([lo for lo, _ in Trace(events).steps], marks)
    spans = list(rec.spans) if rec is not None else []
    if spans and offset is not None:
        events += span_events(spans, offset, os.getpid(), HOST_UPDATE)
    with gzip.open(spec["trace"], "wt") as f:
        json.dump(data, f)
    trace_json.unlink()
    summary = summarize(events)
    engine.flush_delayed_update()
    out = {
        "params": n_params,
        "device": torch.cuda.get_device_name(engine.device) if cuda else "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "step_ms": step_ms,
        "step_ms_median": statistics.median(step_ms) if step_ms else None,
        "losses": losses,
        "trace": spec["trace"],
        "trace_bytes": Path(spec["trace"]).stat().st_size,
        "host_update_thread_spans": len(spans),
        "clock_offset_us": offset,
        "summary": summary,
    }
    if cuda:
        out["cuda_max_allocated_mib"] = torch.cuda.max_memory_allocated(engine.device) / 2**20
    engine.destroy()
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: _overlap_worker.py SPEC_JSON OUT_JSON", file=sys.stderr)
        return 2
    spec, out_path = json.loads(argv[0]), Path(argv[1])
    out_path.write_text(json.dumps(run(spec)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
