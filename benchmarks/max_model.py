"""The largest Llama this machine trains at stage 3 with both offloads, ours and DeepSpeed's.

A ladder of Llama shapes (hidden 2048, depth growing by 2 layers, about 100M params a rung;
vocab 32000, untied head, MLP 11/4 of the width) is searched for each engine and placement:
``cpu`` (both offloads "cpu") and ``nvme`` (both offloads "nvme" under ``--path``). Each
attempt is one fresh process (``host_account.py``'s child: micro batch 1, ``--steps`` steps of
sequence 32) inside a memory cgroup capped at ``--cap-gib``, so the kernel's OOM killer only
ever kills the attempt. An attempt killed by the cgroup, failing with MemoryError or running
past ``--attempt-timeout`` does not fit. The search starts at the rung the memory model predicts
for ours (its host and device terms added: on a CPU they are the same memory; DeepSpeed's at its
measured fp32 rung, see :data:`FP32_RUNGS`) and brackets, then bisects.

``--states`` names the optimizer state formats to search, each its own ladder: ``fp32`` (fp32
training, today's), ``bf16`` (bf16 training, DeepSpeed's ``bf16_master_weights_and_grads`` +
``bf16_optimizer_states``) and ``8bit`` (bf16 training, bf16 master + ``AdamW8bit``; DeepSpeed
has no 8-bit state: its row says "not offered"). The table gives each row's largest against
the fp32 row of the same engine and placement: this run's, else the measured one in
:data:`FP32_RUNGS`. ``--dry-run`` runs nothing: per placement and format it prints the rung each
engine's search would start at, the memory model's bytes there, and ``zero-offload estimate
--max-model``'s answer for the same cap and format.

    python benchmarks/max_model.py --cap-gib 19 --path DIR --placements cpu nvme
    python benchmarks/max_model.py --cap-gib 19 --path DIR --states bf16 8bit --dry-run
    python benchmarks/max_model.py --tiny --placements cpu   # smoke run, uncapped
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "src")]  # fmt: skip

import host_account  # noqa: E402

GIB = 2**30
# Compact states reach further: bf16 states ~2.3B "cpu" / ~5B NVMe in 19 GiB, 8-bit moments
# ~3B / ~7B (the estimate's answers), so the ladders go past those.
LADDER = tuple((layers, 2048) for layers in range(2, 81, 2))  # to 4.1B
NVME_LADDER = tuple((layers, 2048) for layers in range(2, 161, 2))  # to 8.2B: past the disk here
TINY_LADDER = tuple((layers, 64) for layers in range(1, 5))
CGROUP = Path("/sys/fs/cgroup/memory/zero_offload_max_model")
# The fp32 rungs measured on the real ladder at --cap-gib 19 (docs/benchmarks.md, "The largest
# model this machine trains"): (engine, placement, sub_group_size given) -> layers of width
# 2048. DeepSpeed's NVMe row depends on sub_group_size (its swapper's buffers); ours does not.
FP32_RUNGS = {
    ("zero_offload", "cpu", False): 18, ("zero_offload", "cpu", True): 18,
    ("deepspeed", "cpu", False): 10, ("deepspeed", "cpu", True): 10,
    ("zero_offload", "nvme", False): 48, ("zero_offload", "nvme", True): 48,
    ("deepspeed", "nvme", False): 6, ("deepspeed", "nvme", True): 18,
}  # fmt: skip


def params_of(layers: int, hidden: int, vocab: int) -> int:
    """The Llama's parameter count: attention 4 h^2, MLP 3 h f, two norms, embeddings and head."""
    ffn = hidden * 11 // 4
    return layers * (4 * hidden * hidden + 3 * hidden * ffn + 2 * hidden) + hidden * (2 * vocab + 1)


def plan_of(args):
    """The memory model's plan of an attempt's config: its placement, buffers, training dtype
    and optimizer state format (``ZeroPlan.state``, from the config's bf16 block and optimizer
    type, as the engine reads them)."""
    from zero_offload.config.loading.load import load_config
    from zero_offload.runtime.plan.memory_model import ZeroPlan

    cfg = host_account.config(
        args.bucket, args.live, args.offload, args.nvme_path or "/", args.sub_group, args.states
    )
    return ZeroPlan.from_config(load_config(cfg, 1), 1)


def predicted_bytes(layers: int, hidden: int, args) -> tuple[int, int]:
    """``estimate``'s step peak for ours on a CPU: host and device totals added (one memory
    here) and the process's own bytes (malloc's free heap, the interpreter and torch); and the
    bytes of its swap files on the drive."""
    from zero_offload.cli.estimate.step import CPU_PROCESS_BYTES
    from zero_offload.runtime.plan.memory_model import StepShape, predict
    from zero_offload.runtime.plan.model_shape import ModelShape

    heads = max(1, hidden // 64)
    shape = ModelShape.llama(layers, hidden, heads, args.vocab, hidden * 11 // 4, heads)
    pred = predict(shape, StepShape(1, args.seq), plan_of(args))
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
# Failures of the environment, not of the size: no rung can train, so the search stops there.
_BROKEN = (("async_io op", "DeepSpeed's async_io op cannot load (its NVMe swapper needs libaio-dev)"),
           ("assert dtype == self.dtype", "DeepSpeed's NVMe optimizer swapper takes fp32 states only "
            "(swap_tensor/utils.py, SwapBufferManager.allocate: assert dtype == self.dtype)"))  # fmt: skip


class Broken(Exception):
    """An attempt failed for a reason no smaller rung avoids (``_BROKEN``)."""


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

    out = {"layers": layers, "hidden": hidden, "params": params_of(layers, hidden, args.vocab),
           "states": args.states}  # fmt: skip
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
        broken = next((w for k, w in _BROKEN if k in p.stderr), None)
        last = (p.stderr.strip().splitlines() or [""])[-1][-200:]
        why = broken or next((w for k, w in _WHY if k in p.stderr), f"exit {p.returncode}: {last}")
        return out | {"error": why, "tail": p.stderr[-1500:], "broken": broken is not None}
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


def predicted_rung(args, ladder: tuple) -> int | None:
    """The index of the largest rung the memory model fits in ``--cap-gib`` and the drive's
    free bytes, for ours with ``args.states``; None where none fits."""
    cap, disk = args.cap_gib * GIB, args.disk_free

    def fits_prediction(n: int, h: int) -> bool:
        host, swap = predicted_bytes(n, h, args)
        return host <= cap and swap <= disk

    predicted = [i for i, (n, h) in enumerate(ladder) if fits_prediction(n, h)]
    return predicted[-1] if predicted else None


def start_rung(args, engine: str, ladder: tuple, pred_i: int | None) -> int:
    """Where the search begins: ``--start-layers``; else for DeepSpeed on the real ladder its
    measured fp32 rung (a format's states are never larger than fp32's, so it fits and the
    search climbs from there); else the memory model's rung for ours."""
    layers = args.start_layers
    if not layers and engine == "deepspeed" and not args.tiny:
        layers = FP32_RUNGS[(engine, args.offload, bool(args.sub_group))]
    if layers:
        return min(range(len(ladder)), key=lambda i: abs(ladder[i][0] - layers))
    return pred_i or 0


def not_offered(args, engine: str) -> dict | None:
    """The row of a format the engine does not have (DeepSpeed's 8-bit moments), else None."""
    if engine == "deepspeed" and args.states not in host_account.DEEPSPEED_STATES:
        return {"engine": engine, "offload": args.offload, "states": args.states,
                "not_offered": f"DeepSpeed 0.19.8 has no {args.states} optimizer state"}  # fmt: skip
    return None


def largest(args, engine: str, ladder: tuple) -> dict:
    """The search for one engine, placement and state format: every attempt, the largest that
    trained and the smallest that did not."""
    pred_i = predicted_rung(args, ladder)
    start = start_rung(args, engine, ladder, pred_i)
    tried: dict[int, dict] = {}

    def fits(i: int) -> bool:
        tried[i] = attempt(args, engine, *ladder[i])
        row = tried[i]
        print(f"  {engine} {args.offload} {args.states} {row['layers']} x {row['hidden']} "
              f"({row['params'] / 1e6:.0f}M): {row.get('error', 'trained')}", flush=True)  # fmt: skip
        if row.get("broken"):
            raise Broken(row["error"])
        return "error" not in row

    predicted = ladder[pred_i] if pred_i is not None else None
    out = {"engine": engine, "offload": args.offload, "states": args.states,
           "sub_group": args.sub_group, "predicted": predicted,
           "predicted_params": params_of(*predicted, args.vocab) if predicted else 0}  # fmt: skip
    try:
        lo, hi = search(len(ladder), start, fits)
    except Broken as err:
        return out | {"failed": str(err), "attempts": list(tried.values())}
    return out | {"fit": tried.get(lo), "next": tried.get(hi), "attempts": list(tried.values())}


def estimate_command(args, cfg_path: str) -> list[str]:
    """``zero-offload estimate --max-model`` for this run's cap, drive, config and format (no
    ``--device-memory``: a CPU run, device terms in host memory)."""
    cmd = [sys.executable, "-m", "zero_offload.cli.main", "estimate", "--max-model",
           "--model", "llama", "--vocab-size", str(args.vocab), "--seq-length", str(args.seq),
           "--dtype", host_account.training(args.states), "--stage", "3",
           "--host-memory", f"{args.cap_gib * GIB / 1e9:.2f}", "--config", cfg_path,
           "--states", args.states]  # fmt: skip
    if args.offload == "nvme":
        cmd += ["--nvme-size", f"{args.disk_free / 1e9:.1f}"]
    return cmd


def estimate_row(args) -> tuple[str, str]:
    """The estimate's command (its config a temporary file) and its row for this placement
    (both offloads on it), as it prints them."""
    cfg = host_account.config(
        args.bucket, args.live, args.offload, args.path or "/", args.sub_group, args.states
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cfg.json"
        path.write_text(json.dumps(cfg))
        cmd = estimate_command(args, str(path))
        src = str(Path(__file__).resolve().parents[1] / "src")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}  # fmt: skip
        p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.exit(f"zero-offload estimate failed:\n{p.stderr[-2000:]}")
    both = ["3", args.offload, args.offload]  # stage, offload_optimizer, offload_param
    rows = [ln for ln in p.stdout.splitlines() if ln.split()[:3] == both]
    shown = " ".join(["zero-offload", *cmd[3:]]).replace(str(path), "cfg.json")
    return shown, rows[0] if rows else "(no row)"


def dry_run(args, ladder: tuple) -> None:
    """Per engine, the rung the search would start at, the memory model's bytes there and its
    largest rung; and the estimate's answer for the same cap and format. Runs no attempt."""
    pred_i = predicted_rung(args, ladder)
    plan = plan_of(args)
    print(f"{args.offload} {args.states}: the memory model's plan: state {plan.state.name}, "
          f"{plan.dtype_bytes}-byte params")  # fmt: skip
    if pred_i is None:
        print(f"{args.offload} {args.states}: the memory model fits no rung of the ladder")
    else:
        n, h = ladder[pred_i]
        host, swap = predicted_bytes(n, h, args)
        params = params_of(n, h, args.vocab)
        print(f"{args.offload} {args.states}: memory model's largest rung (ours) {n} x {h} "
              f"({params / 1e9:.2f}B): {host / GIB:.2f} GiB in memory, {swap / 1e9:.1f} GB of "
              f"swap files")  # fmt: skip
    for engine in args.engines:
        if not_offered(args, engine):
            print(f"  {engine}: not offered ({not_offered(args, engine)['not_offered']})")
            continue
        i = start_rung(args, engine, ladder, pred_i)
        n, h = ladder[i]
        print(f"  {engine}: the search starts at {n} x {h} "
              f"({params_of(n, h, args.vocab) / 1e9:.2f}B)")  # fmt: skip
    cmd, row = estimate_row(args)
    print(f"  estimate: {cmd}\n    {row}")
    got = row.split()[3] if row != "(no row)" else ""
    if pred_i is not None and got.replace(".", "", 1).isdigit():
        ratio = float(got) * 1e9 / params_of(*ladder[pred_i], args.vocab)
        print(f"  estimate / memory model's rung: {ratio:.3f}")


def fp32_reference(r: dict, results: list[dict], args) -> tuple[int, str] | None:
    """The params of the fp32 row ``r`` compares with: this run's fp32 row of the same engine
    and placement, else (the real ladder only) the measured rung of :data:`FP32_RUNGS`."""
    for o in results:
        if (o["engine"], o["offload"], o["states"]) == (r["engine"], r["offload"], "fp32"):
            if o.get("fit") and o is not r:
                return o["fit"]["params"], "this run"
    if args.tiny:
        return None
    layers = FP32_RUNGS[(r["engine"], r["offload"], bool(args.sub_group))]
    return params_of(layers, 2048, args.vocab), "measured"


def _row(r: dict, results: list[dict], args) -> str:
    head = f"| {r['engine']} | {r['offload']} | {r['states']} |"
    if "not_offered" in r:
        return f"{head} not offered ({r['not_offered']}) | - | - | - | - |"
    if "failed" in r:
        return f"{head} failed: {r['failed']} | - | - | - | - |"
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
    ref = fp32_reference(r, results, args)
    ratio = "-"
    if ref is not None and fit is not None:
        ratio = f"{fit['params'] / ref[0]:.2f}x ({ref[0] / 1e9:.2f}B, {ref[1]})"
    return f"{head} {size} | {peak} | {why} | {pred} | {ratio} |"


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
    ap.add_argument("--states", nargs="+", default=["fp32"], dest="formats",
                    choices=list(host_account.STATES),
                    help="optimizer state formats, a search each (bf16, 8bit: bf16 training)")  # fmt: skip
    ap.add_argument("--steps", type=int, default=3, help="training steps of an attempt (>= 2)")
    ap.add_argument("--dry-run", action="store_true",
                    help="run nothing: the rungs the searches start at and the estimate's answer")  # fmt: skip
    ap.add_argument("--json", help="write every attempt here")
    args = ap.parse_args()
    if args.steps < 2:
        ap.error(
            f"--steps must be >= 2 (a step after the first reads the updated states), got {args.steps}"
        )
    if "nvme" in args.placements and not args.path:
        ap.error("--placements nvme needs --path: a folder on the NVMe disk for the swap files")
    args.vocab, args.seq, args.bucket, args.live = 32000, 32, 1e7, 1e7
    if args.tiny:
        args.vocab, args.bucket, args.live = 128, 1e5, 1e5
    from zero_offload.kernels.bench import _cpu_name

    cap = "uncapped (toy ladder)" if args.tiny else f"{args.cap_gib:g} GiB memory cgroup"
    print(f"CPU: {_cpu_name()} ({os.cpu_count()} cores); {cap}; "
          f"Llama, states {' '.join(args.formats)} (fp32 training for fp32 states, else bf16), "
          f"stage 3, micro batch 1, {args.steps} steps of {args.seq} tokens")  # fmt: skip
    results = []
    for offload in args.placements:
        args.offload, args.nvme_path = offload, ""
        ladder = TINY_LADDER if args.tiny else NVME_LADDER if offload == "nvme" else LADDER
        args.disk_free = float("inf")
        if offload == "nvme":  # the memory model's largest is also bounded by the drive
            Path(args.path).mkdir(parents=True, exist_ok=True)
            args.disk_free = shutil.disk_usage(args.path).free
            print(f"nvme: {args.disk_free / 1e9:.0f} GB free on the disk of --path", flush=True)
        for states in args.formats:
            args.states = states
            if args.dry_run:
                dry_run(args, ladder)
                continue
            for engine in args.engines:
                skip = not_offered(args, engine)
                if skip:
                    print(f"  {engine} {offload} {states}: not offered ({skip['not_offered']})")
                results.append(skip or largest(args, engine, ladder))
    if args.dry_run:
        return
    print(
        "| engine | offloads | states | largest that trained | peak anon RSS / cgroup peak, steps "
        "| next rung | memory model's largest (ours) | against fp32 |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    for r in results:
        print(_row(r, results, args))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
