"""Benchmark of the host update path (shared by ``zero-offload bench`` and
``benchmarks/host_update.py``).

For each size it times one optimizer step of the ZeRO-Offload host update, bf16 grad in and
bf16 param out, along four paths that share the same master/exp_avg/exp_avg_sq buffers:

* ``kernel``    -- :func:`zero_offload.kernels.host_adam_step` (one call, one pass)
* ``torch``     -- unscale into an fp32 grad (``g32.copy_(grad).mul_(scale)``),
                   ``torch.optim.AdamW(fused=True)`` step, ``param_out.copy_(master)``
* ``deepspeed`` -- the same unscale, ``DeepSpeedCPUAdam`` step (AdamW mode), the same copy
                   (only when deepspeed and its cpu_adam op are available)
* ``states_*``  -- :func:`zero_offload.kernels.adam_step_states` with compact states (bf16
                   master and moments, with and without stochastic rounding; 8-bit moments with
                   a bf16 or fp32 master), each over its own buffers, and ``deepspeed_bf16``:
                   DeepSpeedCPUAdam with bf16 param, grad and moments (see bench_states)
* bound         -- 28 bytes/param (2 read grad + 12 read + 12 write + 2 write) divided by the
                   memory bandwidth measured in the same run, taking the best of:
                   an in-place fp32 triad ``a += s*b`` over two 256 MiB arrays (read a, read b,
                   write a: 12 bytes/element, no write-allocate ambiguity), run by torch and by
                   the compiled probe; and the "traffic" probe, which streams exactly the
                   kernel's five arrays (28 bytes/param) with no math. On machines where more
                   concurrent streams reach more bandwidth, the traffic probe sets the bound,
                   so "% of bound" never flatters the kernel.

Measurements are interleaved (one round = every path once) and repeated; the table reports the
median time per step. Every path uses the same thread count. "% bound" is each path's
throughput against the bandwidth divided by that path's own bytes per parameter.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from zero_offload.kernels.bench_states import BYTES as STATE_BYTES
from zero_offload.kernels.bench_states import LABELS as STATE_LABELS
from zero_offload.kernels.bench_states import state_paths

BYTES_PER_PARAM = 28  # bf16 grad read (2) + master/exp_avg/exp_avg_sq read (12) and write (12)
#                       + bf16 param_out write (2)
TRIAD_ELEMS = 64 << 20  # 2 x 256 MiB fp32: far beyond any L3
DEFAULT_SIZES = (10_000_000, 50_000_000, 200_000_000)
QUICK_SIZES = (1_000_000,)

HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
GRAD_SCALE = 1.0 / 1024.0


def parse_size(text: str) -> int:
    t = text.strip().upper().replace("_", "")
    mult = 1
    for suffix, m in (("K", 10**3), ("M", 10**6), ("G", 10**9), ("B", 10**9)):
        if t.endswith(suffix):
            t, mult = t[:-1], m
            break
    value = float(t) * mult
    if value < 1 or value != math.floor(value):
        raise argparse.ArgumentTypeError(f"invalid size {text!r}")
    return int(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sizes",
        nargs="+",
        type=parse_size,
        default=None,
        metavar="N",
        help="parameter counts, e.g. 10M 50M 200M (default: all three)",
    )
    parser.add_argument("--quick", action="store_true", help="one small size (1M params)")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="threads for every path (default: zero_offload default_threads())",
    )
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds per size (median)")
    parser.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeedCPUAdam")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write results as JSON")


def _time_call(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _load_deepspeed(log: Callable[[str], None]):
    """DeepSpeedCPUAdam class, or (None, reason). Its op JIT-compiles on first use."""
    try:
        import deepspeed  # noqa: F401
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        from deepspeed.ops.op_builder import CPUAdamBuilder
    except Exception as exc:  # not installed or broken
        return None, f"deepspeed not importable ({type(exc).__name__}: {exc})"
    try:
        t0 = time.perf_counter()
        CPUAdamBuilder().load()
        dt = time.perf_counter() - t0
        if dt > 5:
            log(f"deepspeed cpu_adam op built/loaded in {dt:.0f} s")
    except Exception as exc:
        return None, f"deepspeed cpu_adam op failed to build/load ({type(exc).__name__}: {exc})"
    return DeepSpeedCPUAdam, None


def run_benchmark(
    sizes: Sequence[int] = DEFAULT_SIZES,
    threads: int | None = None,
    repeats: int = 7,
    include_deepspeed: bool = True,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Runs the measurement and returns {"meta": ..., "rows": [...]} (see format_table)."""
    import torch

    from zero_offload.kernels import host_adam as ha

    threads = threads or ha.default_threads()
    if threads < 1 or repeats < 1:
        raise ValueError("threads and repeats must be >= 1")
    os.environ["OMP_NUM_THREADS"] = str(threads)  # DeepSpeed's OpenMP runtime (loaded later)
    torch.set_num_threads(threads)
    info = ha.kernel_info()
    C = ha._C if info["kernel"] == "cpp" else None

    ds_cls, ds_reason = (None, "disabled (--no-deepspeed)")
    if include_deepspeed:
        ds_cls, ds_reason = _load_deepspeed(log)
        if ds_cls is None:
            log(f"skipping DeepSpeedCPUAdam: {ds_reason}")

    meta = {
        "threads": threads,
        "repeats": repeats,
        "kernel": info,
        "torch": torch.__version__,
        "cpu": _cpu_name(),
        "cores_visible": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "python": platform.python_version(),
        "deepspeed": None if ds_cls is None else _ds_version(),
        "deepspeed_skipped": ds_reason if ds_cls is None else None,
        "bytes_per_param": BYTES_PER_PARAM,
        "hyperparameters": dict(HP, grad_scale=GRAD_SCALE, adamw=True),
    }
    rows: list[dict[str, Any]] = []
    triad_a = torch.randn(TRIAD_ELEMS)
    triad_b = torch.randn(TRIAD_ELEMS)
    for n in sizes:
        rows.extend(_bench_size(n, threads, repeats, C, ds_cls, triad_a, triad_b, log))
        gc.collect()
    return {"meta": meta, "rows": rows}


def _bench_size(n, threads, repeats, C, ds_cls, triad_a, triad_b, log) -> list[dict[str, Any]]:
    import torch

    log(f"[{n / 1e6:g}M params] allocating ...")
    b = {
        "master": torch.randn(n).mul_(0.02),
        "exp_avg": torch.zeros(n),
        "exp_avg_sq": torch.zeros(n),
        "grad": torch.randn(n).to(torch.bfloat16),
        "param_out": torch.empty(n, dtype=torch.bfloat16),
        "g32": torch.empty(n),
    }
    paths = _update_paths(b, threads, ds_cls)
    paths += state_paths(n, threads, HP, GRAD_SCALE, ds_cls)
    probes, traffic_bufs = _probes(n, threads, C, triad_a, triad_b)
    everything = probes + paths
    for _, fn in everything:  # warm-up: page faults, JIT, thread pools
        fn()
    times: dict[str, list[float]] = {name: [] for name, _ in everything}
    log(f"[{n / 1e6:g}M params] timing {', '.join(times)} x {repeats} (interleaved) ...")
    for _ in range(repeats):
        for name, fn in everything:
            times[name].append(_time_call(fn))
    del traffic_bufs  # alive until the probes that read them were timed
    return _rows(n, [name for name, _ in paths], times)


def _update_paths(b: dict, threads, ds_cls) -> list[tuple[str, Callable[[], Any]]]:
    """One step of each Adam implementation over the same buffers (``b``)."""
    import torch

    from zero_offload.kernels import host_adam_step

    master, exp_avg, exp_avg_sq = b["master"], b["exp_avg"], b["exp_avg_sq"]
    grad, param_out, g32 = b["grad"], b["param_out"], b["g32"]
    param = torch.nn.Parameter(master, requires_grad=True)  # shares master's storage
    param.grad = g32
    steps = {"kernel": 0}
    hp = HP

    def kernel_step():
        steps["kernel"] += 1
        host_adam_step(
            master,
            exp_avg,
            exp_avg_sq,
            grad,
            param_out,
            step=steps["kernel"],
            adamw=True,
            grad_scale=GRAD_SCALE,
            threads=threads,
            **hp,
        )

    betas = (hp["beta1"], hp["beta2"])
    common = dict(lr=hp["lr"], betas=betas, eps=hp["eps"], weight_decay=hp["weight_decay"])
    torch_opt = torch.optim.AdamW([param], **common, fused=True)
    torch_opt.state[param] = {
        "step": torch.tensor(0.0),
        "exp_avg": exp_avg,
        "exp_avg_sq": exp_avg_sq,
    }

    def step_with(opt):
        def step():
            g32.copy_(grad).mul_(GRAD_SCALE)
            opt.step()
            param_out.copy_(master)

        return step

    paths: list[tuple[str, Callable[[], Any]]] = [
        ("kernel", kernel_step),
        ("torch", step_with(torch_opt)),
    ]
    if ds_cls is not None:
        ds_opt = ds_cls([param], **common, adamw_mode=True)
        ds_opt.state[param] = {"step": 0, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        paths.append(("deepspeed", step_with(ds_opt)))
    return paths


def _probes(n, threads, C, triad_a, triad_b):
    """Bandwidth probes: torch's triad, and with the compiled module its triad and a probe that
    moves the update's bytes without its math. Returns (probes, the buffers they read)."""
    import torch

    def torch_triad():
        triad_a.add_(triad_b, alpha=0.5)

    probes: list[tuple[str, Callable[[], Any]]] = [("triad_torch", torch_triad)]
    if C is None:
        return probes, None

    def c_triad():
        C.bandwidth_probe(0, triad_a.data_ptr(), triad_b.data_ptr(), 0, 0, 0, TRIAD_ELEMS, threads)

    traffic_bufs = [torch.zeros(n) for _ in range(3)]
    traffic_bufs += [torch.zeros(n, dtype=torch.bfloat16) for _ in range(2)]
    tb = [t.data_ptr() for t in traffic_bufs]

    def traffic():
        C.bandwidth_probe(1, tb[0], tb[1], tb[2], tb[3], tb[4], n, threads)

    return probes + [("triad_probe", c_triad), ("traffic_probe", traffic)], traffic_bufs


def _rows(n: int, paths: list[str], times: dict[str, list[float]]) -> list[dict[str, Any]]:
    """One row per update path and the traffic probe, against the memory-bandwidth bound."""
    med = {k: statistics.median(v) for k, v in times.items()}
    triad_bytes = 3 * TRIAD_ELEMS * 4
    bw = {k: triad_bytes / med[k] for k in ("triad_torch", "triad_probe") if k in med}
    if "traffic_probe" in med:
        bw["traffic_probe"] = BYTES_PER_PARAM * n / med["traffic_probe"]
    bound_by = max(bw, key=bw.get)
    bandwidth = bw[bound_by]
    bound_pps = bandwidth / BYTES_PER_PARAM
    kernel_pps = n / med["kernel"]
    labels = {
        "kernel": "zero_offload host_adam_step",
        "torch": "torch AdamW(fused) path",
        "deepspeed": "DeepSpeedCPUAdam path",
        "traffic_probe": "traffic probe (same 28 B/param, no math)",
        **STATE_LABELS,
    }

    def row(name: str) -> dict[str, Any]:
        pps = n / med[name]
        nbytes = STATE_BYTES.get(name, BYTES_PER_PARAM)
        return {
            "path": labels[name],
            "key": name,
            "params": n,
            "median_s": med[name],
            "min_s": min(times[name]),
            "mparams_per_s": pps / 1e6,
            "ratio_vs_kernel": pps / kernel_pps,
            "bytes_per_param": nbytes,
            "pct_of_bound": 100 * pps * nbytes / bandwidth,
        }

    rows = [row(name) for name in paths]
    if "traffic_probe" in med:
        rows.append(row("traffic_probe"))
    rows.append(
        {
            "path": f"bound: 28 B/param @ {bandwidth / 1e9:.1f} GB/s ({bound_by})",
            "key": "bound",
            "params": n,
            "median_s": n / bound_pps,
            "min_s": None,
            "mparams_per_s": bound_pps / 1e6,
            "ratio_vs_kernel": bound_pps / kernel_pps,
            "bytes_per_param": BYTES_PER_PARAM,
            "pct_of_bound": 100.0,
            "bandwidth_gbs": {k: v / 1e9 for k, v in bw.items()},
            "bound_by": bound_by,
        }
    )
    return rows


def format_table(result: dict[str, Any]) -> str:
    meta = result["meta"]
    k = meta["kernel"]
    lines = [
        f"host update path, bf16 grad in -> bf16 param out, AdamW, {meta['threads']} threads, "
        f"median of {meta['repeats']} interleaved rounds",
        f"kernel: {k['kernel']} isa={k['isa']} simd_width={k['simd_width']}; torch "
        f"{meta['torch']}; deepspeed {meta['deepspeed'] or 'n/a'}; cpu: {meta['cpu']}",
        f"{'path':<44} {'params':>8} {'B/param':>7} {'s/step':>9} {'Mparams/s':>10} "
        f"{'vs kernel':>9} {'% bound':>8}",
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['path']:<44} {r['params'] / 1e6:>7g}M {r['bytes_per_param']:>7.2f} "
            f"{r['median_s']:>9.4f} "
            f"{r['mparams_per_s']:>10.1f} {r['ratio_vs_kernel']:>8.2f}x {r['pct_of_bound']:>7.1f}%"
        )
    for r in result["rows"]:
        if r["key"] == "bound":
            detail = ", ".join(f"{k} {v:.1f}" for k, v in r["bandwidth_gbs"].items())
            lines.append(f"bandwidth at {r['params'] / 1e6:g}M (GB/s): {detail}")
    lines.append(
        "vs kernel = path throughput / kernel throughput (below 1.00x: slower than the "
        "kernel); % bound = throughput / (best measured bandwidth / the path's B/param)"
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    sizes = list(QUICK_SIZES) if args.quick else (args.sizes or list(DEFAULT_SIZES))
    repeats = args.repeats
    result = run_benchmark(
        sizes,
        threads=args.threads,
        repeats=repeats,
        include_deepspeed=not args.no_deepspeed,
        log=lambda s: print(s, file=sys.stderr, flush=True),
    )
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ds_version() -> str | None:
    try:
        import deepspeed

        return deepspeed.__version__
    except Exception:
        return None
