"""DeepSpeedCPUAdam as a standalone optimizer: ``optimizer.step()`` time of this package's
``zero_offload.ops.adam.DeepSpeedCPUAdam`` against torch's fused CPU AdamW and DeepSpeed's
``DeepSpeedCPUAdam``, on identical copies of the same params and gradients, in one run.

    python benchmarks/cpu_adam_optimizer.py                    # 10M and 50M fp32 params
    python benchmarks/cpu_adam_optimizer.py --sizes 1M --dtype bf16

Each optimizer sees the same parameter list (tensors of mixed sizes, as a model has) with a
gradient set once; the timed call is ``step()`` only (median of --repeats after --warmup).
DeepSpeed's cpu_adam op is JIT-compiled on first use (outside the timed calls); without
DeepSpeed its column is skipped.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))

_SUFFIX = {"K": 1e3, "M": 1e6, "B": 1e9}
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _count(text: str) -> int:
    text = text.strip().upper()
    return int(float(text[:-1]) * _SUFFIX[text[-1]]) if text[-1] in _SUFFIX else int(text)


def _params(numel: int, dtype: torch.dtype, seed: int = 0) -> list[torch.nn.Parameter]:
    """Tensors of a model's mix of sizes (a few large, many small, odd lengths) summing to numel."""
    gen = torch.Generator().manual_seed(seed)
    sizes, left, k = [], numel, 0
    while left > 0:
        n = min(left, [numel // 4 + 3, numel // 16 + 1, 4099, 769][k % 4])
        sizes.append(max(1, n))
        left -= sizes[-1]
        k += 1
    out = []
    for n in sizes:
        p = torch.nn.Parameter(torch.randn(n, generator=gen).to(dtype))
        p.grad = (torch.randn(n, generator=gen) * 1e-2).to(dtype)
        out.append(p)
    return out


def _clone(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    out = []
    for p in params:
        q = torch.nn.Parameter(p.detach().clone())
        q.grad = p.grad.clone()
        out.append(q)
    return out


def _time(opt: torch.optim.Optimizer, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        opt.step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _optimizers(dtype: torch.dtype):
    from zero_offload.ops.adam import DeepSpeedCPUAdam

    hyper = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    yield "zero_offload DeepSpeedCPUAdam", lambda ps: DeepSpeedCPUAdam(ps, **hyper)
    if dtype == torch.float32:  # torch's fused CPU AdamW needs fp32 state beside fp32 params
        yield "torch AdamW(fused=True)", lambda ps: torch.optim.AdamW(ps, fused=True, **hyper)
    try:
        from _ds_compat import select_accelerator

        select_accelerator()
        from deepspeed.ops.adam import DeepSpeedCPUAdam as DS

        yield "deepspeed DeepSpeedCPUAdam", lambda ps: DS(ps, **hyper)
    except Exception as exc:  # not installed, or its op does not build here
        print(f"deepspeed DeepSpeedCPUAdam skipped: {type(exc).__name__}: {exc}")


def _cpu() -> str:
    from zero_offload.kernels.bench import _cpu_name
    from zero_offload.kernels.host_adam import kernel_info

    info = kernel_info()
    return (
        f"{_cpu_name()} ({os.cpu_count()} logical CPUs, {platform.machine()}); "
        f"host kernel {info['kernel']} {info['isa']} x{info['simd_width']}, "
        f"{info['threads']} threads; torch {torch.__version__}, {torch.get_num_threads()} threads"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["10M", "50M"])
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    dtype = _DTYPES[args.dtype]
    print(_cpu())
    header = f"{'params':>8} {'optimizer':<30} {'median step':>12} {'Mparams/s':>10} {'ratio':>22}"
    print(header)
    for size in args.sizes:
        numel = _count(size)
        base = _params(numel, dtype)
        rows = []
        for name, make in _optimizers(dtype):
            seconds = _time(make(_clone(base)), args.warmup, args.repeats)
            rows.append((name, seconds))
        ours = rows[0][1]
        for name, seconds in rows:
            ratio = "1.00" if seconds == ours else f"{seconds / ours:.2f}x ours' time"
            print(
                f"{size:>8} {name:<30} {seconds * 1e3:>9.1f} ms {numel / seconds / 1e6:>10.0f} "
                f"{ratio:>22}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
