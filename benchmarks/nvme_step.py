"""The NVMe stage-3 step against DeepSpeed's and against the disk, in one run.

Both engines train the same model (a stack of residual ``Linear(dim, dim)`` blocks, stage 3,
optimizer state and params on NVMe, the same config dict, ``aio`` section included) in fresh
processes on the same folder; DeepSpeed runs under its own interpreter (``--deepspeed-python``,
an environment with DeepSpeed 0.19.8 whose ``async_io`` op builds: libaio-dev installed). The
dtype is bf16 where the CPU has AMX (or a GPU is present), fp32 otherwise (``--dtype``).

Printed:
- the disk: sequential O_DIRECT baseline and the aio engine with the run's threads and queue
  depth, medians of 3, each direction's best taken as the disk's bandwidth;
- the disk under the step's own pattern: whole optimizer-state records read while others are
  written, ``buffer_count`` in flight (``nvme_disk_mixed.py``), bytes read + written per second;
- the floors: the swapped optimizer state (fp32 master and two moments, 12 bytes/param) read
  and written once, alone and with the param traffic (read in the forward and the backward,
  written after the update), each at the one-direction rates (a disk serving one direction at
  a time) and at the mixed rate. The goal's floor is the state AND the params (a step with
  both on NVMe must move both) at the better of the two rates;
- per engine: median step time (steps after the first) and of ``step()`` alone (the update;
  the rest is the forward and backward with their param reads), peak RSS, losses;
- the ratios: ours / DeepSpeed's step (goal at most 0.8), ours / the goal's floor (goal at
  most 1.25), DeepSpeed's / floor, ours / DeepSpeed's peak RSS;
- with ``--trace PATH``: ours' I/O timeline (``ZERO_OFFLOAD_NVME_TRACE``) per phase of each
  step: disk busy and idle time, the longest idle gap, bytes read and written.

    python benchmarks/nvme_step.py --path /mnt/nvme/bench --deepspeed-python <env>/bin/python

Defaults (dim 4096, 16 layers: 268M params, a 3.0 GiB optimizer state, 4 steps) run in a few
minutes on a machine with a local NVMe drive. Smoke test: ``--dim 256 --layers 2 --steps 2
--disk-gib 0.05``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nvme_offload  # noqa: E402  (the child process and the disk measurement)
from nvme_disk_mixed import measure_mixed  # noqa: E402

from zero_offload.kernels.bench import _cpu_name as cpu_name  # noqa: E402
from zero_offload.nvme.io.aio import AioPolicy  # noqa: E402
from zero_offload.runtime.update.placement import CHUNK_ALIGN, MAX_CHUNK  # noqa: E402

GIB = 2**30
BUFFER_COUNT = 4  # offload_optimizer.buffer_count: the config leaves DeepSpeed's default


def default_dtype() -> str:
    """bf16 where the CPU multiplies it in hardware (AMX) or a GPU runs the model."""
    if torch.cuda.is_available():
        return "bf16"
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "fp32"
    return "bf16" if "amx_bf16" in flags else "fp32"


def floors(
    params: int, dtype: str, read_gbps: float, write_gbps: float, mixed_gbps: float
) -> dict[str, float]:
    """Seconds the disk needs per step for the optimizer state (12 B/param, read and written)
    and for that plus the param shard (read in the forward and the backward, written after the
    update): one direction at a time at ``read_gbps`` / ``write_gbps``, and both at once at
    ``mixed_gbps`` (bytes read plus written per second). ``goal``: the state and the params at
    the better of the two, the floor the step is held to."""
    state = 12 * params
    p = params * (2 if dtype == "bf16" else 4)
    r, w, m = read_gbps * 1e9, write_gbps * 1e9, mixed_gbps * 1e9
    out = {"state": state / r + state / w, "state+params": (state + 2 * p) / r + (state + p) / w}
    out |= {"state mixed": 2 * state / m, "state+params mixed": (2 * state + 3 * p) / m}
    out["goal"] = min(out["state+params"], out["state+params mixed"])
    return out


def median_step(run: dict, key: str = "times") -> float:
    return statistics.median(run[key][1:] or run[key])


def show(name: str, run: dict) -> None:
    if "error" in run:
        print(f"  {name:16} error: {run['error']}")
        return
    update = median_step(run, "update_times")
    print(f"  {name:16} median step {median_step(run):7.3f} s (step() {update:.3f} s)  peak RSS "
          f"{run['peak_rss'] / GIB:6.2f} GiB  losses {[round(x, 4) for x in run['losses']]}")  # fmt: skip


def ratios(ours: dict, ds: dict | None, floor: dict[str, float]) -> None:
    if "error" in ours:
        return
    a = median_step(ours)
    print(f"  ours / floor (state+params, the goal's) {a / floor['goal']:.2f}x (goal <= 1.25); "
          f"ours / floor (state alone) {a / floor['state']:.2f}x")  # fmt: skip
    if ds is None or "error" in ds:
        return
    b = median_step(ds)
    print(f"  ours / DeepSpeed step {a / b:.2f}x (goal <= 0.8); DeepSpeed / floor "
          f"{b / floor['goal']:.2f}x; ours / DeepSpeed peak RSS "
          f"{ours['peak_rss'] / ds['peak_rss']:.2f}x")  # fmt: skip


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--path", type=Path, default=Path("nvme-step-bench"))
    ap.add_argument(
        "--deepspeed-python", default="", help="DeepSpeed's interpreter (omit: ours only)"
    )
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument(
        "--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 with AMX"
    )
    ap.add_argument("--disk-gib", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=1, help="aio intra_op_parallelism")
    ap.add_argument("--queue-depth", type=int, default=8, help="aio queue_depth")
    ap.add_argument("--run-timeout", type=float, default=600, help="seconds per training run")
    ap.add_argument("--json", type=Path, help="also write the runs here")
    ap.add_argument(
        "--trace", type=Path, help="record ours' I/O timeline here and print it per phase"
    )
    args = ap.parse_args(argv)
    args.dtype = args.dtype or default_dtype()
    aio = {"block_size": 1 << 20, "queue_depth": args.queue_depth,
           "intra_op_parallelism": args.threads, "single_submit": False, "overlap_events": True}  # fmt: skip
    args.aio = json.dumps(aio)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    args.path.mkdir(parents=True, exist_ok=True)
    params = args.dim * args.dim * args.layers
    print(f"cpu: {cpu_name()} ({os.cpu_count()} cores); torch {torch.__version__}; "
          f"folder {args.path} ({nvme_offload.filesystem(args.path)})")  # fmt: skip
    print(f"model: stage 3, {args.dtype}, {params / 1e6:.1f}M params ({args.layers} x Linear "
          f"{args.dim}), optimizer state {12 * params / GIB:.2f} GiB, {args.steps} steps; "
          f"aio {args.aio}")  # fmt: skip
    bw = nvme_offload.disk(args.path, args.disk_gib, args.threads, args.queue_depth)
    read = max(bw["baseline_read_gbps"], bw["read_gbps"])
    write = max(bw["baseline_write_gbps"], bw["write_gbps"])
    print(f"\n[disk] {args.disk_gib:g} GiB, medians of 3 (GB/s): sequential O_DIRECT write "
          f"{bw['baseline_write_gbps']:.2f} read {bw['baseline_read_gbps']:.2f}; aio engine "
          f"({bw['backend']}) write {bw['write_gbps']:.2f} read {bw['read_gbps']:.2f}; "
          f"taken: read {read:.2f}, write {write:.2f}")  # fmt: skip
    record = 12 * min(MAX_CHUNK, -(-params // CHUNK_ALIGN) * CHUNK_ALIGN)
    records = max(2, int(args.disk_gib * GIB) // (2 * record))
    policy = AioPolicy(threads=args.threads, queue_depth=args.queue_depth)
    mixed = measure_mixed(args.path, record, records, BUFFER_COUNT, policy)
    bw["mixed_gbps"] = mixed["mixed_gbps"]
    print(f"[disk, mixed] {records} records of {record / 2**20:.0f} MiB read while {records} "
          f"are written, {BUFFER_COUNT} in flight (the step's pattern): {bw['mixed_gbps']:.2f} "
          "GB/s read + written")  # fmt: skip
    floor = floors(params, args.dtype, read, write, bw["mixed_gbps"])
    print(f"[floor] one direction at a time: optimizer state read + written "
          f"{floor['state']:.3f} s, with the params {floor['state+params']:.3f} s; mixed: "
          f"{floor['state mixed']:.3f} s, {floor['state+params mixed']:.3f} s; the goal's "
          f"floor (state+params, the better): {floor['goal']:.3f} s")  # fmt: skip
    if args.trace:  # read by the child (ours only): ZERO_OFFLOAD_NVME_TRACE
        os.environ["ZERO_OFFLOAD_NVME_TRACE"] = str(args.trace.resolve())
    ours = nvme_offload.run_child(args, "nvme")
    os.environ.pop("ZERO_OFFLOAD_NVME_TRACE", None)
    ds = None
    if args.deepspeed_python:
        ds = nvme_offload.run_child(args, "nvme", engine="deepspeed", python=args.deepspeed_python)
    print("\n[step]")
    show("zero_offload", ours)
    if ds is not None:
        show("DeepSpeed", ds)
    ratios(ours, ds, floor)
    if args.trace and args.trace.exists():
        from zero_offload.nvme.io.trace_report import load, phases, table

        print("\n[disk timeline of ours]")
        print(table(phases(load(args.trace))))
    if args.json:
        args.json.write_text(
            json.dumps({"disk": bw, "floor": floor, "ours": ours, "deepspeed": ds})
        )
    failed = "error" in ours or (ds is not None and "error" in ds)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
