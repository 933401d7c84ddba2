"""Step time and memory of the engine against plain PyTorch and DeepSpeed, same model, same config.

For each world size and dtype, every run in its own processes (one per rank, fresh memory):

- ``torch``: plain PyTorch, ``AdamW(fused=True)``, the same clipping (DDP on gloo at world > 1);
- ``engine``: stage 0, 1, 2, stage 1 and 2 with ``offload_optimizer: {device: cpu}``, stage 2
  offload with ``delayed_update``, and stage 3 without offload, with ``offload_optimizer``, and
  with ``offload_optimizer`` + ``offload_param``;
- ``deepspeed``: the same modes but the delayed update (DeepSpeedCPUAdam under offload), from the
  same config dict (a failure shows its error in the table);
- ``fsdp2``: PyTorch FSDP2 (``fully_shard`` per transformer block and the root), as the stage-3
  anchor: without offload, and with ``CPUOffloadPolicy`` (params and optimizer state on the host).

``--ratio`` adds the stage-3 optimizer-offload modes of the engine and DeepSpeed at each partial
offload ratio given (``offload_optimizer.ratio``: the host's share of the optimizer state, the
rest updated on the device in the same step): the fastest ratio for a model and a machine is the
row to pick. ``--stages`` picks the ZeRO stages; stage 3's ``stage3_prefetch_bucket_size``,
``stage3_param_persistence_threshold`` and ``stage3_max_live_parameters`` are the same numbers for
the engine and DeepSpeed (``--prefetch-bucket``, ``--persistence-threshold``, ``--max-live``).

Prints one Markdown table: median seconds per step over the timed steps (a step ends when its
slowest rank does) with the interquartile range, tokens/s (all ranks), time ratios against plain
PyTorch, DeepSpeed's same mode and, at stage 3, FSDP2's same mode (> 1: slower), peak RSS of the largest rank, bytes of live
tensors after the last step (rank 0), the engine's ``memory_report()`` and its formula
``expected_memory()`` as device/host MiB, and rank 0's last loss (the same model, data and
recipe: fp32 runs agree to rounding).

    python benchmarks/engine_step.py --quick --world 1 --no-deepspeed   # smoke test, < 60 s
    python benchmarks/engine_step.py --world 1 2 --json results.json    # the full table
    python benchmarks/engine_step.py --stages 3 --world 1 2             # the stage-3 rows only
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _launch import cores, launch, prebuild_deepspeed  # noqa: E402
from _report import add_ratios, merge_rounds, summarize, table  # noqa: E402
from _spec import DTYPES, IMPLS, Run, Shape, stage3_auto  # noqa: E402

# (layers, hidden, heads, seq, micro, steps, warmup): --quick, and the default full size.
QUICK = dict(layers=2, hidden=64, heads=4, seq=64, micro=2, steps=3, warmup=1)
FULL = dict(layers=8, hidden=512, heads=8, seq=256, micro=2, steps=10, warmup=2)


# (stage, offload_optimizer, delayed update, offload_param) of the ZeRO runs; the delayed update
# is the engine's only; FSDP2 runs stage 3 only, and offloads params and optimizer state together.
ZERO_MODES = (
    (0, False, False, False),
    (1, False, False, False),
    (2, False, False, False),
    (1, True, False, False),
    (2, True, False, False),
    (3, False, False, False),
    (3, True, False, False),
    (3, True, False, True),
)
ENGINE_ONLY_MODES = ((2, True, True, False),)
FSDP2_MODES = ((3, False, False, False), (3, True, False, True))
STAGES = (0, 1, 2, 3)


def matrix(
    worlds: list[int],
    dtypes: list[str],
    impls: list[str],
    stages: tuple[int, ...] = STAGES,
    ratios: tuple[float, ...] = (),
) -> list[Run]:
    """Every run of the given ZeRO stages, grouped by world size then dtype, the plain PyTorch
    anchor first (always, as every row's ``x torch`` needs it); each stage-3 optimizer-offload
    mode of the engine and DeepSpeed also at every partial-offload ratio of ``ratios``."""
    modes = {
        "engine": ZERO_MODES + ENGINE_ONLY_MODES,
        "deepspeed": ZERO_MODES,
        "fsdp2": FSDP2_MODES,
    }
    runs = []
    for world in worlds:
        for dtype in dtypes:
            if "torch" in impls:
                runs.append(Run("torch", 0, False, False, world, dtype))
            for impl in ("engine", "deepspeed", "fsdp2"):
                if impl in impls:
                    runs += [
                        Run(impl, s, o, d, world, dtype, offload_param=op, ratio=r)
                        for s, o, d, op in sorted(modes[impl], key=lambda m: m[0] == 3)
                        if s in stages
                        for r in _ratios(impl, s, o, d, ratios)
                    ]
    return runs


def _ratios(impl: str, stage: int, offload: bool, delayed: bool, ratios) -> list[float]:
    """The ratios a mode runs at: 1.0, and each of ``ratios`` for a stage-3 optimizer offload
    of the engine or DeepSpeed (FSDP2 has no partial offload)."""
    twin = impl in ("engine", "deepspeed") and stage == 3 and offload and not delayed
    return [1.0, *(r for r in ratios if r < 1.0)] if twin else [1.0]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"tiny model, few steps: {QUICK}")
    for name in ("layers", "hidden", "heads", "seq", "micro", "steps", "warmup"):
        p.add_argument(
            f"--{name}",
            type=int,
            default=None,
            help=f"default {FULL[name]} ({QUICK[name]} with --quick)",
        )
    p.add_argument(
        "--bucket",
        type=float,
        default=1e7,
        help="reduce_bucket_size and allgather_bucket_size in elements (default 1e7)",
    )
    p.add_argument(
        "--stages",
        type=int,
        nargs="+",
        choices=STAGES,
        default=list(STAGES),
        help="ZeRO stages to run (default 0 1 2 3; the plain PyTorch anchor always runs)",
    )
    p.add_argument(
        "--ratio",
        type=float,
        nargs="+",
        default=[],
        help="stage 3: also run every optimizer-offload mode at these offload_optimizer.ratio "
        "values (partial offload: the host's share of the optimizer state, e.g. 0.25 0.5 0.75)",
    )
    p.add_argument(
        "--prefetch-bucket",
        type=float,
        default=None,
        help="stage 3: stage3_prefetch_bucket_size in elements, for the engine and DeepSpeed "
        "(default int(0.9 * hidden^2), DeepSpeed's 'auto')",
    )
    p.add_argument(
        "--persistence-threshold",
        type=float,
        default=None,
        help="stage 3: stage3_param_persistence_threshold in elements (default 10 * hidden, "
        "DeepSpeed's 'auto': biases and norms stay whole, every weight matrix is partitioned)",
    )
    p.add_argument(
        "--max-live",
        type=float,
        default=1e9,
        help="stage 3: stage3_max_live_parameters (default 1e9, DeepSpeed's default)",
    )
    p.add_argument(
        "--modes",
        nargs="+",
        default=None,
        help="only these ZeRO modes, as STAGE:OFFLOAD with OFFLOAD one of - cpu cpu+delayed "
        "cpu+param (e.g. 0:- 2:cpu 2:cpu+delayed 3:cpu+param; default all of --stages)",
    )
    p.add_argument(
        "--deepspeed-modes",
        nargs="+",
        default=None,
        help="DeepSpeed's rows only in these modes (same form as --modes; default: --modes)",
    )
    p.add_argument(
        "--host-reserve-gib",
        type=float,
        default=0.0,
        help="stop a run when the host's available memory falls under this (default 0: off)",
    )
    p.add_argument("--vocab", type=int, default=256, help="vocabulary size (default 256, bytes)")
    p.add_argument(
        "--gas", type=int, default=1, help="micro-steps per step (gradient_accumulation_steps)"
    )
    p.add_argument(
        "--checkpoint", action="store_true", help="activation checkpointing on every block"
    )
    p.add_argument(
        "--zero-init",
        action="store_true",
        help="stage 3: the engine builds the model under zero_offload.zero.Init (DeepSpeed "
        "and FSDP2 build it whole)",
    )
    p.add_argument("--world", type=int, nargs="+", default=[1, 2], help="world sizes (default 1 2)")
    p.add_argument(
        "--dtype",
        nargs="+",
        choices=DTYPES,
        default=["fp32"],
        help="training dtypes (default fp32: without AVX-512 BF16/AMX, bf16 matmuls on "
        "the CPU are many times slower than fp32)",
    )
    p.add_argument(
        "--impls", nargs="+", choices=IMPLS, default=list(IMPLS), help="implementations to run"
    )
    p.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeed rows")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="intra-op threads per rank (default: the cores split between the ranks; 1 avoids "
        "OpenMP barrier stalls when other processes share the cores)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure every run this many times, interleaved, and pool the timed steps "
        "(evens out a shared machine's changing load; default 1)",
    )
    p.add_argument("--timeout", type=float, default=600, help="seconds per run (default 600)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    base = QUICK if args.quick else FULL
    for name in base:
        if getattr(args, name) is None:
            setattr(args, name, base[name])
        if getattr(args, name) <= 0 and name != "warmup":
            p.error(f"--{name} must be a positive integer, got {getattr(args, name)}")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.hidden % args.heads:
        p.error(f"--hidden ({args.hidden}) must be divisible by --heads ({args.heads})")
    if any(w < 1 for w in args.world):
        p.error(f"--world sizes must be >= 1, got {args.world}")
    if args.bucket < 1:
        p.error(f"--bucket must be >= 1 element, got {args.bucket}")
    for name, size in stage3_auto(args.hidden).items():  # DeepSpeed's "auto" where not given
        if getattr(args, name) is None:
            setattr(args, name, size)
    for name in ("prefetch_bucket", "persistence_threshold", "max_live"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    bad_ratios = [r for r in args.ratio if not 0.0 <= r <= 1.0]
    if bad_ratios:
        p.error(f"--ratio values must be in [0, 1], got {bad_ratios}")
    if args.vocab < 1 or args.gas < 1:
        p.error(f"--vocab and --gas must be >= 1, got {args.vocab} and {args.gas}")
    # The STAGE:OFFLOAD names that --modes and --deepspeed-modes accept.
    known = {f"{st}:{Run('engine', st, o, d, 1, 'fp32', op).mode}" for st, o, d, op in
             ZERO_MODES + ENGINE_ONLY_MODES}  # fmt: skip
    for flag in ("modes", "deepspeed_modes"):
        modes = getattr(args, flag)
        if modes is None:
            continue
        modes = [m if ":" in m else f"{m}:-" for m in modes]
        bad = [m for m in modes if m not in known]
        if bad:
            p.error(f"--{flag.replace('_', '-')}: unknown {bad}; known: {sorted(known)}")
        setattr(args, flag, modes)
    if args.no_deepspeed:
        args.impls = [i for i in args.impls if i != "deepspeed"]
    return args


def _meta(args: argparse.Namespace, shape: Shape) -> dict[str, Any]:
    import torch

    meta: dict[str, Any] = {
        "shape": dataclasses.asdict(shape),
        "cores": cores(),
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "loadavg_start": os.getloadavg(),
    }
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from zero_offload.kernels.host_adam import kernel_info

    meta["host_adam"] = kernel_info()
    if "deepspeed" in args.impls:
        from importlib.metadata import PackageNotFoundError, version

        try:
            meta["deepspeed"] = version("deepspeed")
        except PackageNotFoundError:
            meta["deepspeed"] = None
    return meta


def _header(shape: Shape, meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    params = next((r["params"] for r in rows if "params" in r), 0)
    adam = meta["host_adam"]
    return (
        f"\nGPT-2 {shape.layers} layers, hidden {shape.hidden}, {shape.heads} heads, vocab 256, "
        f"seq {shape.seq}, micro batch {shape.micro}: {params / 1e6:.1f}M params\n"
        + (
            f"stage 3: stage3_prefetch_bucket_size {shape.prefetch_bucket}, "
            f"stage3_param_persistence_threshold {shape.persistence_threshold}, "
            f"stage3_max_live_parameters {shape.max_live}\n"
            if any(r["stage"] == 3 for r in rows)
            else ""
        )
        + f"{shape.steps} timed steps after {shape.warmup} warm-up, x {meta['rounds']} round(s); "
        f"{meta['cores']} cores, {meta['threads']} thread(s) per rank; torch {meta['torch']}, "
        f"deepspeed {meta.get('deepspeed', '-')}; host Adam {adam['kernel']}/{adam['isa']}; "
        f"load average {meta['loadavg_start'][0]:.1f} -> {meta['loadavg_end'][0]:.1f}\n"
    )


def _write_json(
    path: Path, meta: dict[str, Any], shape: Shape, runs: list, results: list[list[dict]]
) -> None:
    """The rows of the runs that have a result so far (all rounds' results merged), with their
    ratios, written whole and then renamed (a reader never sees half a file)."""
    rows = [summarize(shape, r, merge_rounds(res)) for r, res in zip(runs, results) if res]
    add_ratios(rows)
    out = {"meta": meta, "rows": [{k: v for k, v in r.items() if k != "run"} for r in rows]}
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(json.dumps(out, indent=1))
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shape = Shape(
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        seq=args.seq,
        micro=args.micro,
        steps=args.steps,
        warmup=args.warmup,
        bucket=int(args.bucket),
        prefetch_bucket=int(args.prefetch_bucket),
        persistence_threshold=int(args.persistence_threshold),
        max_live=int(args.max_live),
        vocab=args.vocab,
        gas=args.gas,
        checkpoint=args.checkpoint,
        zero_init=args.zero_init,
    )
    meta = _meta(args, shape)
    meta.update(rounds=args.rounds, threads=args.threads or "cores/world")
    runs = matrix(args.world, args.dtype, args.impls, tuple(args.stages), tuple(args.ratio))
    if args.modes is not None:
        runs = [r for r in runs if r.impl == "torch" or f"{r.stage}:{r.base_mode}" in args.modes]
    if args.deepspeed_modes is not None:
        runs = [
            r
            for r in runs
            if r.impl != "deepspeed" or f"{r.stage}:{r.base_mode}" in args.deepspeed_modes
        ]
    ds_runs = [r for r in runs if r.impl == "deepspeed"]
    ds_error = None
    if ds_runs:
        if meta["deepspeed"] is None:
            ds_error = "deepspeed is not installed"
        else:
            # Only the Adam builds the runs use (FusedAdam is a CUDA build on a GPU machine).
            ops = {"cpu_adam" if r.offload else "fused_adam" for r in ds_runs}
            print(f"building DeepSpeed's ops {sorted(ops)} (once) ...", file=sys.stderr, flush=True)
            ds_error = prebuild_deepspeed(args.timeout, sorted(ops))
    results: list[list[dict[str, Any]]] = [[] for _ in runs]
    t_start = time.perf_counter()
    for rnd in range(args.rounds):
        # Alternate the order so that a slow drift of the machine's load does not favour one end
        # of the matrix.
        order = list(range(len(runs))) if rnd % 2 == 0 else list(reversed(range(len(runs))))
        for n, i in enumerate(order, 1):
            run, t0 = runs[i], time.perf_counter()
            if run.impl == "deepspeed" and ds_error:
                result: dict[str, Any] = {"error": ds_error}
            else:
                result = launch(
                    shape, run, args.timeout, args.threads, int(args.host_reserve_gib * 2**30)
                )
            results[i].append(result)
            if args.json:  # the rows finished so far: a run cut off later leaves them
                _write_json(args.json, meta, shape, runs, results)
            said = result.get("error") or "{:.3f} s/step".format(
                sorted(max(r["wall"][k] for r in result["ranks"]) for k in range(shape.steps))[
                    shape.steps // 2
                ]
            )
            print(
                f"[round {rnd + 1}/{args.rounds}, {n}/{len(runs)}] {run.label}: {said} "
                f"({time.perf_counter() - t0:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    rows = [summarize(shape, run, merge_rounds(res)) for run, res in zip(runs, results)]
    add_ratios(rows)
    meta["loadavg_end"] = os.getloadavg()
    meta["elapsed_s"] = time.perf_counter() - t_start

    print(_header(shape, meta, rows))
    print(table(rows))
    anchors = {(r["impl"], r["stage"], r["offload"], r["info"]) for r in rows if "info" in r}
    for impl, stage, offload, info in sorted(anchors):
        if impl != "engine":
            print(f"  {impl} stage {stage} offload {offload}: {info}")
    if args.json:
        _write_json(args.json, meta, shape, runs, results)
    return 1 if all("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
