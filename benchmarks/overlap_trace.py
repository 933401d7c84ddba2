"""How much of an offloaded step's copying and host work hides behind GPU compute: torch.profiler
traces of the engine, analysed per step.

Three modes of one GPT-2 (byte vocabulary, activation checkpointing), world 1, each in a fresh
process (``_overlap_worker.py``):

- ``stage2``: stage 2 with ``offload_optimizer`` (grads device->host in backward, host Adam,
  updated params host->device chunk by chunk while the next chunk computes);
- ``stage2-delayed``: the same with ``delayed_update`` (the host pass of step t runs during the
  forward and backward of step t+1);
- ``stage3``: stage 3 with ``offload_optimizer`` and ``offload_param`` (params fetched
  host->device per module, prefetched ahead).

Each mode warms up, times steps without the profiler, then profiles a few steps (CPU and CUDA
activities) and writes the Chrome trace to ``--out`` (``<mode>.json.gz``; open it in Perfetto or
chrome://tracing). Prints one Markdown table (a row per mode, medians over the profiled steps)
and writes ``--out``/summary.json with every step's numbers (``_trace.py`` says how they are
computed).

    python benchmarks/overlap_trace.py --out traces/              # CUDA: 354.0M params, bf16
    python benchmarks/overlap_trace.py --device cpu --out /tmp/t  # tiny CPU run (smoke test)

Without CUDA (or with ``--device cpu``) it runs a tiny fp32 model on the CPU: the trace then has
no GPU events, so only the step and host-update columns are filled.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _launch import _why  # noqa: E402
from _spec import Run, Shape, stage3_auto, to_json  # noqa: E402

WORKER = HERE / "_overlap_worker.py"

# name -> (stage, offload_optimizer, delayed_update, offload_param)
MODES: dict[str, tuple[int, bool, bool, bool]] = {
    "stage2": (2, True, False, False),
    "stage2-delayed": (2, True, True, False),
    "stage3": (3, True, False, True),
}

# Model and step counts on a GPU (354.0M params, bf16) and for the CPU smoke run.
CUDA_SIZE = dict(layers=28, hidden=1024, heads=16, seq=1024, micro=8, warmup=2, steps=4, profile=3)
CPU_SIZE = dict(layers=2, hidden=64, heads=4, seq=64, micro=2, warmup=2, steps=2, profile=2)

PCT = "{:.0f}"


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="auto: CUDA when available, else the tiny CPU run",
    )
    for name in ("layers", "hidden", "heads", "seq", "micro"):
        p.add_argument(
            f"--{name}",
            type=int,
            default=None,
            help=f"default {CUDA_SIZE[name]} on CUDA, {CPU_SIZE[name]} on the CPU",
        )
    p.add_argument("--warmup", type=int, default=None, help="unmeasured steps first")
    p.add_argument("--steps", type=int, default=None, help="steps timed without the profiler")
    p.add_argument("--profile-steps", type=int, default=None, help="steps in the trace")
    p.add_argument(
        "--dtype", choices=("bf16", "fp32"), default=None, help="default bf16 on CUDA, fp32 on CPU"
    )
    p.add_argument(
        "--modes", nargs="+", choices=list(MODES), default=list(MODES), help="modes to run"
    )
    p.add_argument(
        "--bucket", type=float, default=1e7, help="reduce/allgather bucket size (elements)"
    )
    p.add_argument(
        "--no-overlap-comm",
        action="store_true",
        help="overlap_comm false (default true: reductions on their own stream)",
    )
    p.add_argument(
        "--no-checkpoint",
        action="store_true",
        help="no activation checkpointing (default: every transformer block recomputed)",
    )
    p.add_argument(
        "--out", type=Path, default=Path("overlap_traces"), help="folder for traces and JSON"
    )
    p.add_argument("--timeout", type=float, default=300, help="seconds per mode (default 300)")
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if _cuda_available() else "cpu"
    elif args.device == "cuda" and not _cuda_available():
        p.error("--device cuda: CUDA is not available")
    size = CUDA_SIZE if args.device == "cuda" else CPU_SIZE
    for name in ("layers", "hidden", "heads", "seq", "micro", "warmup", "steps"):
        if getattr(args, name) is None:
            setattr(args, name, size[name])
    if args.profile_steps is None:
        args.profile_steps = size["profile"]
    if args.dtype is None:
        args.dtype = "bf16" if args.device == "cuda" else "fp32"
    for name in ("layers", "hidden", "heads", "seq", "micro", "profile_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0 or args.steps < 0:
        p.error("--warmup and --steps must be >= 0")
    if args.hidden % args.heads:
        p.error(f"--hidden ({args.hidden}) must be divisible by --heads ({args.heads})")
    return args


def shape_of(args: argparse.Namespace) -> Shape:
    return Shape(
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        seq=args.seq,
        micro=args.micro,
        steps=args.steps,
        warmup=args.warmup,
        bucket=int(args.bucket),
        **stage3_auto(args.hidden),  # DeepSpeed's "auto"
    )


def spec_of(args: argparse.Namespace, mode: str, trace: Path) -> dict[str, Any]:
    stage, offload, delayed, offload_param = MODES[mode]
    run = Run("engine", stage, offload, delayed, 1, args.dtype, offload_param=offload_param)
    return {
        **to_json(shape_of(args), run),
        "warmup": args.warmup,
        "steps": args.steps,
        "profile_steps": args.profile_steps,
        "checkpoint_activations": not args.no_checkpoint,
        "overlap_comm": not args.no_overlap_comm,
        "trace": str(trace),
    }


def _child_env(device: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
    }
    env["PYTHONWARNINGS"] = "ignore"
    if device == "cpu":
        env["ZERO_OFFLOAD_DEVICE"] = "cpu"
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def run_mode(spec: dict[str, Any], device: str, timeout: float) -> dict[str, Any]:
    """One mode in its own process: its result, or ``{"error": ...}``."""
    with tempfile.TemporaryDirectory(prefix="overlap_") as tmp:
        out = Path(tmp) / "result.json"
        try:
            done = subprocess.run(
                [sys.executable, str(WORKER), json.dumps(spec), str(out)],
                capture_output=True,
                text=True,
                timeout=timeout,
                env=_child_env(device),
            )
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        if done.returncode != 0 or not out.exists():
            return {"error": f"exit {done.returncode}: {_why(done.stderr)}"}
        return json.loads(out.read_text())


# ---- the table -----------------------------------------------------------------------------------
def _fmt(value: float | None, spec: str = "{:.1f}", scale: float = 1.0) -> str:
    return "-" if value is None else spec.format(value * scale)


def _pct(value: float | None, gpu: bool = True) -> str:
    return _fmt(value if gpu else None, PCT, 100.0)


COLUMNS = (
    "mode",
    "step ms",
    "profiled step ms",
    "GPU compute %",
    "H2D %",
    "D2H %",
    "host update %",
    "D2H hidden by compute (bwd) %",
    "H2D hidden by host update %",
    "H2D hidden by compute %",
    "host update hidden by compute %",
    "H2D GB/s",
    "D2H GB/s",
    "H2D/D2H MB",
)


def row_cells(mode: str, result: dict[str, Any]) -> list[str]:
    """One table row from a worker's result (``-`` where the trace has no such events)."""
    if "error" in result:
        return [mode, result["error"]] + [""] * (len(COLUMNS) - 2)
    s = result["summary"]
    m, gpu = s["median"], s["has_gpu"]
    frac, ov, gbps, moved = m["busy_frac"], m["overlap"], m["gbps"], m["bytes"]

    def mb(kind: str) -> str:
        return _fmt(moved.get(kind) if gpu else None, "{:.0f}", 1e-6)

    return [
        mode,
        _fmt(result["step_ms_median"]),
        _fmt(m["window_ms"]),
        _pct(frac.get("compute", 0.0), gpu),
        _pct(frac.get("h2d", 0.0), gpu),
        _pct(frac.get("d2h", 0.0), gpu),
        _pct(frac.get("host_update", 0.0)),
        _pct(ov.get("d2h_compute_backward"), gpu),
        _pct(ov.get("h2d_host_update"), gpu),
        _pct(ov.get("h2d_compute"), gpu),
        _pct(ov.get("host_update_compute"), gpu),
        _fmt(gbps.get("h2d") if gpu else None),
        _fmt(gbps.get("d2h") if gpu else None),
        f"{mb('h2d')}/{mb('d2h')}",
    ]


def table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    t_start = time.perf_counter()
    for mode in args.modes:
        t0 = time.perf_counter()
        trace = (args.out / f"{mode}.json.gz").resolve()
        results[mode] = run_mode(spec_of(args, mode, trace), args.device, args.timeout)
        said = results[mode].get("error") or f"{results[mode]['step_ms_median']:.1f} ms/step"
        print(f"{mode}: {said} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    ok = [r for r in results.values() if "error" not in r]
    head = ok[0] if ok else {}
    shape = shape_of(args)
    print(
        f"\nGPT-2 {shape.layers} layers, hidden {shape.hidden}, {shape.heads} heads, vocab 256, "
        f"seq {shape.seq}, micro batch {shape.micro}"
        + (f": {head['params'] / 1e6:.1f}M params" if head else "")
        + f"; {args.dtype}, activation checkpointing {'off' if args.no_checkpoint else 'on'}, "
        f"overlap_comm {'off' if args.no_overlap_comm else 'on'}; world 1\n"
        f"device {head.get('device', args.device)}, torch {head.get('torch', '-')}, "
        f"{head.get('threads', '-')} host threads; {args.steps} timed steps after "
        f"{args.warmup} warm-up, {args.profile_steps} profiled (medians)\n"
    )
    print(table([row_cells(mode, r) for mode, r in results.items()]))
    meta = {
        "shape": dataclasses.asdict(shape),
        "dtype": args.dtype,
        "device": args.device,
        "checkpoint_activations": not args.no_checkpoint,
        "overlap_comm": not args.no_overlap_comm,
        "profile_steps": args.profile_steps,
        "python": platform.python_version(),
        "elapsed_s": time.perf_counter() - t_start,
    }
    summary = {"meta": meta, "modes": {m: {"config": MODES[m], **r} for m, r in results.items()}}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\ntraces and summary.json in {args.out}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
