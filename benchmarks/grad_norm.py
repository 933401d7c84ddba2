"""The gradient norm's sum of squares: torch's fp32 norm (the path before the kernel) against the
SIMD host kernel (``zero_offload.kernels.sumsq``), and the norm's share of an engine step.

1. Kernel: for each size and dtype, ``vector_norm(x, dtype=float32).square()`` and
   ``sum_of_squares(x)`` on the same host tensor, interleaved, ``--repeats`` times each; the
   median time as GB/s of the tensor's bytes, the ratio (torch time / kernel time) and the two
   results' relative difference against a float64 sum.
2. Engine: a small GPT at stage 3 with ``offload_optimizer`` and ``offload_param`` (both cpu) on
   this machine's CPU, trained twice from the same weights and data, first with every final
   gradient segment's squared norm taken by torch ("before"), then by the kernel ("after"). Each
   step's wall time and the time spent in those norms; medians over the timed steps and the
   norm's share of the step. The losses of both runs are printed (the same model: they agree to
   fp32 rounding of the norm, which only the clip factor sees).

    python benchmarks/grad_norm.py                # 64M and 268M elements, GPT 8x512 (~2-4 min)
    python benchmarks/grad_norm.py --quick        # 1M elements, GPT 2x64, 3 steps (smoke test)
    python benchmarks/grad_norm.py --sizes 268M --dtypes bf16 --skip-engine
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial

import torch

SIZES = {"1M": 1 << 20, "64M": 64 << 20, "268M": 268 << 20}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def cpu_kind() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _time_once(fn: Callable[[], object], times: list[float]) -> None:
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)


def kernel_rows(sizes: list[str], dtypes: list[str], repeats: int) -> list[dict]:
    from zero_offload.kernels.sumsq import sum_of_squares

    rows = []
    for size in sizes:
        for name in dtypes:
            x = torch.empty(SIZES[size], dtype=torch.float32).normal_(0, 1e-3).to(DTYPES[name])
            exact = float(x.double().square().sum())
            paths = {
                "torch": partial(sum_of_squares, x, backend="torch"),
                "kernel": partial(sum_of_squares, x, backend="kernel"),
            }
            times: dict[str, list[float]] = {k: [] for k in paths}
            for fn in paths.values():
                fn()  # warm-up: first touch, thread pool
            for _ in range(repeats):
                for k, fn in paths.items():
                    _time_once(fn, times[k])
            nbytes = x.numel() * x.element_size()
            row = {"size": size, "dtype": name}
            for k, fn in paths.items():
                med = statistics.median(times[k])
                row[f"{k}_s"] = med
                row[f"{k}_GBps"] = nbytes / med / 1e9
                row[f"{k}_relerr"] = abs(float(fn()) - exact) / exact
            row["ratio"] = row["torch_s"] / row["kernel_s"]
            rows.append(row)
            del x
    return rows


def print_kernel_table(rows: list[dict]) -> None:
    print(
        "| elements | dtype | torch GB/s | kernel GB/s | speed-up | torch rel. err | kernel rel. err |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['size']} | {r['dtype']} | {r['torch_GBps']:.2f} | {r['kernel_GBps']:.2f} | "
            f"{r['ratio']:.1f}x | {r['torch_relerr']:.1e} | {r['kernel_relerr']:.1e} |"
        )


def _engine_config(args: argparse.Namespace) -> dict:
    return {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**6,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
        },
        "bf16": {"enabled": args.dtype == "bf16"},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "reduce_bucket_size": 10_000_000,
            "allgather_bucket_size": 10_000_000,
            "offload_optimizer": {"device": "cpu"},
            "offload_param": {"device": "cpu"},
        },
    }


def engine_run(args: argparse.Namespace, backend: str) -> dict:
    """Steps of the small GPT with the segment norms taken by ``backend``; per-step wall time
    and time inside the norms."""
    import zero_offload
    from zero_offload.kernels.sumsq import sum_of_squares
    from zero_offload.models.gpt2 import GPT2Config, GPT2Model
    from zero_offload.runtime.reduce import grad_shard

    spent = [0.0]

    def timed(t: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        out = sum_of_squares(t, backend=backend)
        spent[0] += time.perf_counter() - t0
        return out

    torch.manual_seed(1234)
    cfg = GPT2Config(args.layers, args.hidden, args.heads, args.seq)
    model = GPT2Model(cfg)
    params = sum(p.numel() for p in model.parameters())
    saved, grad_shard.sum_of_squares = grad_shard.sum_of_squares, timed
    try:
        engine, *_ = zero_offload.initialize(model=model, config=_engine_config(args))
        g = torch.Generator().manual_seed(7)
        steps, norms, losses = [], [], []
        for k in range(args.warmup + args.steps):
            x = torch.randint(0, cfg.vocab_size, (args.micro, args.seq), generator=g)
            spent[0] = 0.0
            t0 = time.perf_counter()
            loss = engine(x, x)
            engine.backward(loss)
            engine.step()
            dt = time.perf_counter() - t0
            losses.append(float(loss.detach()))
            if k >= args.warmup:
                steps.append(dt)
                norms.append(spent[0])
        engine.destroy()
    finally:
        grad_shard.sum_of_squares = saved
    step, norm = statistics.median(steps), statistics.median(norms)
    return {
        "params": params,
        "step_s": step,
        "norm_s": norm,
        "share": norm / step,
        "losses": losses,
    }


def print_engine_table(args: argparse.Namespace, before: dict, after: dict) -> None:
    print(
        f"\nengine: GPT {args.layers}x{args.hidden} ({before['params'] / 1e6:.1f}M params), "
        f"{args.dtype}, stage 3 + offload_optimizer + offload_param (cpu), micro {args.micro}, "
        f"seq {args.seq}; medians of {args.steps} steps after {args.warmup} warm-up"
    )
    print("| norm path | s/step | norm s/step | norm share of step |")
    print("| --- | --- | --- | --- |")
    for name, r in (("torch (before)", before), ("kernel (after)", after)):
        print(f"| {name} | {r['step_s']:.3f} | {r['norm_s']:.4f} | {100 * r['share']:.1f}% |")
    print(f"step time after / before: {after['step_s'] / before['step_s']:.3f}")
    print("losses before:", " ".join(f"{v:.5f}" for v in before["losses"]))
    print("losses after: ", " ".join(f"{v:.5f}" for v in after["losses"]))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", choices=list(SIZES), default=["64M", "268M"])
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=["bf16", "fp32"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="engine run dtype")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="1M elements, GPT 2x64, 3 steps")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.repeats = ["1M"], 3
        args.layers, args.hidden, args.heads, args.seq, args.steps, args.warmup = 2, 64, 4, 64, 3, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from zero_offload.kernels import kernel_info
    from zero_offload.kernels.sumsq import kernel_available

    if not kernel_available():
        print("the compiled sum-of-squares kernel is unavailable: build it (pip install -e .)")
        return 1
    info = kernel_info()
    print(f"CPU: {cpu_kind()}; kernel ISA {info['isa']}, {info['threads']} threads; "
          f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads")  # fmt: skip
    print_kernel_table(kernel_rows(args.sizes, args.dtypes, args.repeats))
    if not args.skip_engine:
        before, after = engine_run(args, "torch"), engine_run(args, "auto")
        print_engine_table(args, before, after)
    return 0


if __name__ == "__main__":
    sys.exit(main())
