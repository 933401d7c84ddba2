"""The largest GPT-2 that trains on this machine, per mode, and what stops the next size.

A ladder of GPT-2 shapes (GPT-2's 50257-token vocabulary, seq 1024, micro batch 1, bf16,
activation checkpointing on every block) is climbed for each mode:

- ``stage0``: no offload (params, grads, fp32 master and Adam state on the GPU);
- ``stage2+opt``: ``offload_optimizer`` (fp32 master and Adam state on the host);
- ``stage3+opt+param``: both offloads, the model built under ``zero.Init``.

Each attempt is a fresh process (``_step_worker.py``) that builds the model, trains one warm-up
and two timed steps, and reports the GPU's peak memory (while building, and over the steps), the
host's peak and steady RSS and the engine's own accounting next to its formula. The climb starts
at the largest rung the formula says fits (model states plus an allowance) and goes up until an
attempt fails (CUDA out of memory, or the host's available memory falling under a reserve, when
the attempt is stopped before the kernel's OOM killer acts) or down until one trains.

    python benchmarks/model_size.py --json sizes.json                  # on the GPU machine
    python benchmarks/model_size.py --tiny --host-limit-gib 0.3        # CPU smoke test

Prints one Markdown table: per mode, the largest size that trained with its params, GPU peak,
host peak and steady RSS, host bytes per param (the engine's accounting, and the formula's) and
step time, then why the next size did not train.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path[:0] = [
    str(Path(__file__).resolve().parent),
    str(Path(__file__).resolve().parents[1] / "src"),
]

from _launch import launch, mem_available  # noqa: E402
from _report import GIB, summarize  # noqa: E402
from _spec import Run, Shape, stage3_auto  # noqa: E402

# (layers, hidden, heads): GPT-2 shapes about 13% apart from 1.6B to 8.9B params.
LADDER = (
    (48, 1600, 25),
    (40, 2048, 16),
    (32, 2560, 20),
    (38, 2560, 20),
    (44, 2560, 20),
    (36, 3072, 24),
    (42, 3072, 24),
    (48, 3072, 24),
    (30, 4096, 32),
    (34, 4096, 32),
    (38, 4096, 32),
    (43, 4096, 32),
)
TINY_LADDER = ((2, 64, 4), (4, 128, 4), (6, 192, 4), (8, 256, 4), (8, 384, 4))

MODES = {
    "stage0": Run("engine", 0, False, False, 1, "bf16"),
    "stage2+opt": Run("engine", 2, True, False, 1, "bf16"),
    "stage3+opt+param": Run("engine", 3, True, False, 1, "bf16", offload_param=True),
}


@dataclass
class Attempt:
    rung: int
    result: dict[str, Any]  # the summarized row: measurements, or "error"

    @property
    def ok(self) -> bool:
        return "error" not in self.result


def climb(
    n_rungs: int,
    start: int,
    attempt: Callable[[int], Attempt],
    max_runs: int,
) -> list[Attempt]:
    """Try ``start``; then upwards while attempts train, or downwards until one does, at most
    ``max_runs`` attempts. The largest trained rung is the answer; the attempt above it (if
    any) says what stopped it."""
    tried = [attempt(start)]
    step = 1 if tried[0].ok else -1
    rung = start + step
    while 0 <= rung < n_rungs and len(tried) < max_runs:
        a = attempt(rung)
        tried.append(a)
        if a.ok != tried[0].ok:  # crossed the limit
            break
        rung += step
    return tried


def formula_gib(numel: int, run: Run) -> tuple[float, float]:
    """(device, host) GiB of model states by the engine's formula (one rank)."""
    import torch

    from zero_offload.runtime.plan.memory import expected_bytes

    b = expected_bytes(
        numel, torch.bfloat16, run.stage, run.world, run.offload, offload_param=run.offload_param
    )
    dev = sum(v for k, v in b.items() if k.startswith("device."))
    host = sum(v for k, v in b.items() if k.startswith("host."))
    return dev / GIB, host / GIB


def start_rung(
    numels: list[int], run: Run, gpu_gib: float | None, host_gib: float, allowance_gib: float
) -> int:
    """The largest rung whose formula bytes plus ``allowance_gib`` fit both memories (0 if
    none: the climb then finds out). Without a GPU (``gpu_gib`` None) the "device" is the host."""
    best = 0
    for i, n in enumerate(numels):
        dev, host = formula_gib(n, run)
        if gpu_gib is None:
            dev, host = 0.0, host + dev
        if dev + allowance_gib > gpu_gib if gpu_gib is not None else False:
            continue
        if host + allowance_gib > host_gib:
            continue
        best = i
    return best


def _shape(rung: tuple[int, int, int], args: argparse.Namespace) -> Shape:
    layers, hidden, heads = rung
    return Shape(
        layers=layers,
        hidden=hidden,
        heads=heads,
        seq=args.seq,
        micro=args.micro,
        steps=args.steps,
        warmup=1,
        bucket=int(args.bucket),
        **stage3_auto(hidden),
        vocab=args.vocab,
        checkpoint=True,
        zero_init=True,
    )


def _numel(rung: tuple[int, int, int], args: argparse.Namespace) -> int:
    from zero_offload.models.gpt2 import GPT2Config, num_parameters

    layers, hidden, heads = rung
    return num_parameters(GPT2Config(layers, hidden, heads, args.seq, vocab_size=args.vocab))


def _gpu_gib() -> float | None:
    import torch

    if not torch.cuda.is_available() or os.environ.get("ZERO_OFFLOAD_DEVICE") == "cpu":
        return None
    return torch.cuda.get_device_properties(0).total_memory / GIB


def _row(mode: str, tried: list[Attempt], numels: list[int], run: Run) -> dict[str, Any]:
    ok = [a for a in tried if a.ok]
    best = max(ok, key=lambda a: a.rung) if ok else None
    above = [a for a in tried if not a.ok and (best is None or a.rung > best.rung)]
    stop = min(above, key=lambda a: a.rung) if above else None
    row: dict[str, Any] = {"mode": mode, "attempts": [dataclasses.asdict(a) for a in tried]}
    if best is not None:
        r = best.result
        numel = numels[best.rung]
        acct_host = sum(v for k, v in (r["accounted"] or {}).items() if k.startswith("host."))
        row.update(
            rung=best.rung,
            params=numel,
            gpu_peak_gib=(r.get("gpu_peak_init_gib"), r.get("gpu_peak_steps_gib")),
            host_peak_gib=r["peak_rss_mib"] / 1024,
            host_steady_gib=r["rss_steady_mib"] / 1024,
            host_bytes_per_param=acct_host / numel,
            formula_host_bytes_per_param=formula_gib(numel, run)[1] * GIB / numel,
            rss_bytes_per_param=r["rss_steady_mib"] * 2**20 / numel,
            step_s=r["median_s"],
            init_s=r["init_s"],
        )
    if stop is not None:
        row["next_params"] = numels[stop.rung]
        row["next_failed"] = stop.result["error"]
    elif best is not None and best.rung == len(numels) - 1:
        row["next_failed"] = "largest rung of the ladder trained"
    return row


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "mode",
        "largest trained",
        "GPU peak GiB build/steps",
        "host peak/steady GiB",
        "host B/param acct (formula)",
        "RSS B/param",
        "s/step",
        "next size: why not",
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        if "params" not in r:
            cells = [r["mode"], "none", "", "", "", "", "", r.get("next_failed", "")]
        else:
            g0, g1 = r["gpu_peak_gib"]
            nxt = r.get("next_failed", "not tried (max runs)")
            if "next_params" in r:
                nxt = f"{r['next_params'] / 1e9:.2f}B: {nxt}"
            cells = [
                r["mode"],
                f"{r['params'] / 1e9:.2f}B",
                f"{_f(g0, '.1f')}/{_f(g1, '.1f')}",
                f"{r['host_peak_gib']:.1f}/{r['host_steady_gib']:.1f}",
                f"{r['host_bytes_per_param']:.1f} ({r['formula_host_bytes_per_param']:.1f})",
                f"{r['rss_bytes_per_param']:.1f}",
                f"{r['step_s']:.2f}",
                nxt,
            ]
        lines.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny ladder, byte vocabulary, seq 64")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--seq", type=int, default=None, help="default 1024 (64 with --tiny)")
    p.add_argument("--vocab", type=int, default=None, help="default 50257 (256 with --tiny)")
    p.add_argument("--micro", type=int, default=1)
    p.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up")
    p.add_argument("--bucket", type=float, default=2e8, help="reduce/allgather bucket, elements")
    p.add_argument("--max-runs", type=int, default=3, help="attempts per mode (default 3)")
    p.add_argument(
        "--allowance-gib",
        type=float,
        default=6.0,
        help="memory beyond the formula's model states assumed when picking the first rung "
        "(activations, CUDA context, buffers; default 6)",
    )
    p.add_argument(
        "--host-reserve-gib",
        type=float,
        default=3.0,
        help="stop an attempt when the host's available memory falls under this (default 3)",
    )
    p.add_argument(
        "--host-limit-gib",
        type=float,
        default=None,
        help="treat the host as having this much memory when picking the first rung "
        "(default: available memory now)",
    )
    p.add_argument("--timeout", type=float, default=600, help="seconds per attempt")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    args.seq = args.seq or (64 if args.tiny else 1024)
    args.vocab = args.vocab or (256 if args.tiny else 50257)
    if args.max_runs < 1 or args.micro < 1 or args.steps < 1:
        p.error("--max-runs, --micro and --steps must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ladder = TINY_LADDER if args.tiny else LADDER
    numels = [_numel(r, args) for r in ladder]
    host_gib = args.host_limit_gib or (mem_available() or 0) / GIB
    gpu_gib = _gpu_gib()
    rows, t0 = [], time.perf_counter()
    for mode in args.modes:
        run = MODES[mode]

        def attempt(i: int, run: Run = run, mode: str = mode) -> Attempt:
            shape, t = _shape(ladder[i], args), time.perf_counter()
            result = launch(shape, run, args.timeout, host_reserve=int(args.host_reserve_gib * GIB))
            row = summarize(shape, run, result)
            row.pop("run")
            said = row.get("error") or f"{row['median_s']:.2f} s/step"
            print(
                f"[{mode}] {numels[i] / 1e9:.3f}B params: {said} ({time.perf_counter() - t:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
            return Attempt(i, result=row)

        start = start_rung(numels, run, gpu_gib, host_gib, args.allowance_gib)
        tried = climb(len(ladder), start, attempt, args.max_runs)
        rows.append(_row(mode, tried, numels, run))
    meta = {
        "gpu_gib": gpu_gib,
        "host_available_gib_at_start": host_gib,
        "ladder": [
            dict(zip(("layers", "hidden", "heads"), r)) | {"params": n}
            for r, n in zip(ladder, numels)
        ],  # fmt: skip
        "seq": args.seq,
        "vocab": args.vocab,
        "micro": args.micro,
        "elapsed_s": time.perf_counter() - t0,
    }
    print(
        f"\nGPT-2 ladder, vocab {args.vocab}, seq {args.seq}, micro batch {args.micro}, bf16, "
        f"activation checkpointing; GPU {_f(gpu_gib, '.1f')} GiB, host available "
        f"{host_gib:.1f} GiB at start\n"
    )
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    return 0 if any("params" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
