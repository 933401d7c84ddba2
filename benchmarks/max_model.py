"""The largest Llama this machine trains at stage 3 with both offloads, ours and DeepSpeed's.

A ladder of Llama shapes (hidden 2048, depth growing by 2 layers, about 100M params a rung;
vocab 32000, untied head, MLP 11/4 of the width) is searched for each engine and placement:
``cpu`` (both offloads "cpu") and ``nvme`` (both offloads "nvme" under ``--path``). Each
attempt is one fresh process (``host_account.py``'s child: fp32, micro batch 1, 3 steps of
sequence 32) inside a memory cgroup capped at ``--cap-gib``, so the kernel's OOM killer only
ever kills the attempt. An attempt killed by the cgroup, failing with MemoryError or running
past ``--attempt-timeout`` does not fit. The search starts at the rung the memory model predicts
for ours (its host and device terms added: on a CPU they are the same memory) and brackets,
then bisects.

    python benchmarks/max_model.py --cap-gib 19 --path DIR --placements cpu nvme
    python benchmarks/max_model.py --tiny --placements cpu   # smoke run, uncapped
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "src")]  # fmt: skip

import host_account  # noqa: E402

GIB = 2**30
LADDER = tuple((layers, 2048) for layers in range(2, 41, 2))
NVME_LADDER = tuple((layers, 2048) for layers in range(2, 97, 2))  # to 5B: past the disk here
TINY_LADDER = tuple((layers, 64) for layers in range(1, 5))
CGROUP = Path("/sys/fs/cgroup/memory/zero_offload_max_model")


def params_of(layers: int, hidden: int, vocab: int) -> int:
    """The Llama's parameter count: attention 4 h^2, MLP 3 h f, two norms, embeddings and head."""
    ffn = hidden * 11 // 4
    return layers * (4 * hidden * hidden + 3 * hidden * ffn + 2 * hidden) + hidden * (2 * vocab + 1)


def predicted_bytes(layers: int, hidden: int, args) -> tuple[int, int]:
    """``estimate``'s step peak for ours on a CPU: host and device totals added (one memory
    here) and the process's own bytes (malloc's free heap, the interpreter and torch); and the
    bytes of its swap files on the drive."""
    from zero_offload.cli.estimate.step import CPU_PROCESS_BYTES
    from zero_offload.config.loading.load import load_config
    from zero_offload.runtime.plan.memory_model import StepShape, ZeroPlan, predict
    from zero_offload.runtime.plan.model_shape import ModelShape

    cfg = host_account.config(
        args.bucket, args.live, args.offload, args.nvme_path or "/", args.sub_group
    )
    plan = ZeroPlan.from_config(load_config(cfg, 1), 1)
    heads = max(1, hidden // 64)
    shape = ModelShape.llama(layers, hidden, heads, args.vocab, hidden * 11 // 4, heads)
    pred = predict(shape, StepShape(1, args.seq), plan)
    disk = sum(v for k, v in pred.items() if k.startswith("nvme."))
    return pred["peak.device.total"] + pred["peak.host.total"] + CPU_PROCESS_BYTES, disk


def _cgroup(cap: int) -> Path | None:
    """The capped cgroup (v1), its peak reset for the next attempt; None where none can be made
    (no root, or no v1 memory controller)."""
    try:
        CGROUP.mkdir(exist_ok=True)
        (CGROUP / "memory.limit_in_bytes").write_text(str(cap))
        (CGROUP / "memory.max_usage_in_bytes").write_text("0")
    except OSError:
        return None
    return CGROUP


def _oom_kills(cg: Path | None) -> int:
    if cg is None:
        return 0
    for line in (cg / "memory.oom_control").read_text().splitlines():
        if line.startswith("oom_kill "):
            return int(line.split()[1])
    return 0


_WHY = (("MemoryError", "MemoryError"), ("No space left", "disk full"),
        ("swap files; free space", "disk too small (refused at start)"))  # fmt: skip


def attempt(args, engine: str, layers: int, hidden: int) -> dict:
    """One run of ``layers`` x ``hidden`` under the cap: its measurements, or why it failed."""
    run = argparse.Namespace(**{**vars(args), "layers": layers, "hidden": hidden})
    if args.offload == "nvme":
        run.nvme_path = str(Path(args.path) / engine)
        Path(run.nvme_path).mkdir(parents=True, exist_ok=True)
    cg = None if args.tiny else _cgroup(int(args.cap_gib * GIB))  # a toy run: no cap needed
    if cg is None and not args.tiny:
        sys.exit("no memory cgroup could be made: a real-sized attempt runs only under a cap")
    kills, start = _oom_kills(cg), time.perf_counter()

    def join() -> None:  # in the child, before exec
        if cg is not None:
            (cg / "cgroup.procs").write_text(str(os.getpid()))

    out = {"layers": layers, "hidden": hidden, "params": params_of(layers, hidden, args.vocab)}
    try:
        p = subprocess.run(host_account.child_command(run, engine), capture_output=True,
                           text=True, preexec_fn=join, timeout=args.attempt_timeout)  # fmt: skip
    except subprocess.TimeoutExpired:
        return out | {"error": f"timed out after {args.attempt_timeout:.0f} s"}
    finally:  # swap files an engine leaves behind must not shrink the next attempt's disk
        if args.offload == "nvme":
            shutil.rmtree(run.nvme_path, ignore_errors=True)
    out |= {"wall_s": time.perf_counter() - start,
            "cgroup_peak": int((cg / "memory.max_usage_in_bytes").read_text()) if cg else 0}  # fmt: skip
    if _oom_kills(cg) > kills:
        return out | {"error": "killed by the cgroup's OOM killer"}
    if p.returncode != 0:
        why = next((w for k, w in _WHY if k in p.stderr), f"exit {p.returncode}")
        return out | {"error": why, "tail": p.stderr[-1500:]}
    return out | json.loads(p.stdout.strip().splitlines()[-1])


def search(n: int, start: int, fits: Callable[[int], bool]) -> tuple[int, int]:
    """(largest rung that fits or -1, smallest that does not or n): from ``start``, steps that
    double until the answer is bracketed, then bisection."""
    lo, hi, step, i = -1, n, 1, min(max(start, 0), n - 1)
    while hi - lo > 1:
        if fits(i):
            lo = i
            i = min(i + step, hi - 1) if hi == n else (lo + hi) // 2
        else:
            hi = i
            i = max(i - step, lo + 1) if lo == -1 else (lo + hi) // 2
        step *= 2
    return lo, hi


def largest(args, engine: str, ladder: tuple) -> dict:
    """The search for one engine and placement: every attempt, the largest that trained and
    the smallest that did not."""
    cap, disk = args.cap_gib * GIB, args.disk_free

    def fits_prediction(n: int, h: int) -> bool:
        host, swap = predicted_bytes(n, h, args)
        return host <= cap and swap <= disk

    predicted = [i for i, (n, h) in enumerate(ladder) if fits_prediction(n, h)]
    start = pred_i = predicted[-1] if predicted else 0
    if args.start_layers:  # a known neighbourhood (another engine's answer) instead
        start = min(range(len(ladder)), key=lambda i: abs(ladder[i][0] - args.start_layers))
    tried: dict[int, dict] = {}

    def fits(i: int) -> bool:
        tried[i] = attempt(args, engine, *ladder[i])
        row = tried[i]
        print(f"  {engine} {args.offload} {row['layers']} x {row['hidden']} "
              f"({row['params'] / 1e6:.0f}M): {row.get('error', 'trained')}", flush=True)  # fmt: skip
        return "error" not in row

    lo, hi = search(len(ladder), start, fits)
    return {"engine": engine, "offload": args.offload, "predicted": ladder[pred_i] if predicted else None,
            "predicted_params": params_of(*ladder[pred_i], args.vocab) if predicted else 0,
            "fit": tried.get(lo), "next": tried.get(hi), "attempts": list(tried.values())}  # fmt: skip


def _row(r: dict) -> str:
    fit, nxt = r["fit"], r["next"]
    if fit is None:
        size = "none"
        peak = "-"
    else:
        size = f"{fit['params'] / 1e9:.2f}B ({fit['layers']} x {fit['hidden']})"
        peak = (f"{fit['peak_anon'] / GIB:.1f} / {fit['cgroup_peak'] / GIB:.1f} GiB, "
                f"{fit['steps_s']:.0f} s for the steps")  # fmt: skip
    why = "-" if nxt is None else f"{nxt['params'] / 1e9:.2f}B: {nxt['error']}"
    pred = f"{r['predicted_params'] / 1e9:.2f}B" if r["predicted"] else "none"
    return f"| {r['engine']} | {r['offload']} | {size} | {peak} | {why} | {pred} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cap-gib", type=float, default=19.0, help="the memory cgroup's cap")
    ap.add_argument("--path", default="", help="a folder on the NVMe disk (nvme placement)")
    ap.add_argument("--engines", nargs="+", default=["zero_offload", "deepspeed"])
    ap.add_argument("--placements", nargs="+", default=["cpu", "nvme"], choices=["cpu", "nvme"])
    ap.add_argument("--attempt-timeout", type=float, default=900.0)
    ap.add_argument("--start-layers", type=int, help="start at this depth, not the prediction")
    ap.add_argument("--sub-group", type=float, default=0, help="sub_group_size (0: the default)")
    ap.add_argument("--tiny", action="store_true", help="a toy ladder (smoke run)")
    ap.add_argument("--json", help="write every attempt here")
    args = ap.parse_args()
    args.vocab, args.seq, args.steps, args.bucket, args.live = 32000, 32, 3, 1e7, 1e7
    if args.tiny:
        args.vocab, args.bucket, args.live = 128, 1e5, 1e5
    from zero_offload.kernels.bench import _cpu_name

    print(f"CPU: {_cpu_name()} ({os.cpu_count()} cores); {args.cap_gib:g} GiB memory cgroup; "
          f"Llama fp32, stage 3, micro batch 1, {args.steps} steps of {args.seq} tokens")  # fmt: skip
    results = []
    for offload in args.placements:
        args.offload, args.nvme_path = offload, ""
        ladder = TINY_LADDER if args.tiny else NVME_LADDER if offload == "nvme" else LADDER
        args.disk_free = float("inf")
        if offload == "nvme":  # the memory model's largest is also bounded by the drive
            Path(args.path).mkdir(parents=True, exist_ok=True)
            args.disk_free = shutil.disk_usage(args.path).free
            print(f"nvme: {args.disk_free / 1e9:.0f} GB free on the disk of --path", flush=True)
        for engine in args.engines:
            results.append(largest(args, engine, ladder))
    print(
        "| engine | offloads | largest that trained | peak anon RSS / cgroup peak, steps "
        "| next rung | memory model's largest (ours) |\n| --- | --- | --- | --- | --- | --- |"
    )
    for r in results:
        print(_row(r))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
