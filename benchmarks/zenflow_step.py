"""ZenFlow's step against plain ZeRO-Offload and against DeepSpeed 0.19.8's own ZenFlow, side by
side on this machine's CPU: the same model, data and recipe, one rank, ZeRO stage 2 (``--stage``
1 or 3; stage 3 partitions every param, ``--offload-param`` puts the shard in host memory) with
``offload_optimizer: {device: cpu}``, three rows:

| row | what runs |
| --- | --- |
| `offload` | `zero_offload.initialize`, plain ZeRO-Offload (the host Adam over the whole shard every step) |
| `zenflow` | `zero_offload.initialize` with the `zero_optimization.zenflow` block |
| `deepspeed zenflow` | `deepspeed.initialize`, the same config, DeepSpeed's ZenFlow (its stage 1/2 param binding fixed as `tests/zenflow_run.py` fixes it; at stage 3 its CUDA-only selection buffers put on the CPU, `tests/zenflow_ds3_patches.py`; nothing else changed; its overlapped optimizer process runs as it does) |

The model is a stack of bias-free square Linear layers with tanh between them (no 1-D params:
DeepSpeed 0.19.8's column selection misreads its gradient bucket after one, docs/zenflow.md),
MSE loss, AdamW (lr 1e-3, weight decay 0.01). Each row is a fresh process (DeepSpeed is imported
only in its own); a step is forward, ``backward`` and ``step``; its wall time is measured after
``--warmup`` steps. Printed: the CPU, the median, quartiles and mean of the step times, each
row's ratio (median/mean) to plain offload and to DeepSpeed's ZenFlow (> 1: slower), and the last
loss.

    python benchmarks/zenflow_step.py                       # hidden 1024 x 4 layers (4.2M params)
    python benchmarks/zenflow_step.py --quick               # hidden 64 x 2, 3 steps (smoke test)
    python benchmarks/zenflow_step.py --hidden 2048 --layers 8 --steps 20 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
ROWS = ("offload", "zenflow", "deepspeed zenflow")


def cpu_kind() -> str:
    """``lscpu``'s model name (``/proc/cpuinfo``'s)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def zenflow_block(args: argparse.Namespace) -> dict:
    return {
        "topk_ratio": args.topk_ratio,
        "select_strategy": "step",
        "select_interval": args.select_interval,
        "update_interval": args.update_interval,
        "full_warm_up_rounds": 0,
        "overlap_step": bool(args.overlap_step),
    }


def config(args: argparse.Namespace, zenflow: bool) -> dict:
    zero = {"stage": args.stage, "offload_optimizer": {"device": "cpu"}}
    if args.stage == 3:  # every param partitioned; the param shard where --offload-param says
        zero["stage3_param_persistence_threshold"] = 0
        if args.offload_param:
            zero["offload_param"] = {"device": "cpu"}
    if zenflow:
        zero["zenflow"] = zenflow_block(args)
    return {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
        },
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }


def make_model(hidden: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(hidden, hidden, bias=False), torch.nn.Tanh()]
    return torch.nn.Sequential(*mods[:-1])


def worker(args: argparse.Namespace) -> dict:
    """One row in this process: the step times and losses."""
    for k, v in {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "LOCAL_RANK": "0",
                 "WORLD_SIZE": "1", "MASTER_PORT": str(29500 + os.getpid() % 2000)}.items():  # fmt: skip
        os.environ.setdefault(k, v)
    torch.set_num_threads(args.threads)
    if args.worker == "deepspeed zenflow":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        sys.path.insert(0, str(REPO / "tests"))
        from zenflow_ds3_patches import fix_stage3_devices
        from zenflow_run import fix_deepspeed_binding

        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        fix_deepspeed_binding()  # stages 1-2
        if args.stage == 3:  # its CUDA-only selection buffers on the CPU
            fix_stage3_devices()
        initialize = deepspeed.initialize
    else:
        import zero_offload

        initialize = zero_offload.initialize
    model = make_model(args.hidden, args.layers)
    cfg = config(args, zenflow=args.worker != "offload")
    engine, *_ = initialize(model=model, model_parameters=model.parameters(), config=cfg)
    device = next(engine.module.parameters()).device  # the GPU where there is one
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(1)
    walls, losses = [], []
    for i in range(args.warmup + args.steps):
        x = torch.randn(args.micro, args.hidden, generator=g).to(device)
        y = torch.randn(args.micro, args.hidden, generator=g).to(device)
        sync()
        t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        sync()
        wall = time.perf_counter() - t0
        if i >= args.warmup:
            walls.append(wall)
        losses.append(float(loss.detach()))
    params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # stage 3
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {"wall": walls, "losses": losses, "params": params, "gpu": gpu}


def run_row(args: argparse.Namespace, row: str) -> dict:
    argv = [sys.executable, __file__, "--worker", row, *args.argv]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout,
                              cwd=REPO)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"row": row, "error": f"did not finish in --timeout {args.timeout:g} s"}
    marker = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode != 0 or not marker:
        return {"row": row, "error": (done.stderr or done.stdout)[-500:].strip()}
    return stats(row, json.loads(marker[-1][len("RESULT ") :]))


def in_process_row(args: argparse.Namespace, row: str) -> dict:
    """``--in-process``: the row in this process (no fresh interpreter: the GPU check's short
    run); an error is the row's, as in its own process."""
    try:
        return stats(row, worker(argparse.Namespace(**{**vars(args), "worker": row})))
    except Exception as err:  # noqa: BLE001 - reported in the table, like a failed process
        return {"row": row, "error": f"{type(err).__name__}: {err}"}


def stats(row: str, out: dict) -> dict:
    """Median, quartiles and mean of the step times. ZenFlow's steps are two kinds (with a host
    update every ``update_interval``-th, without one between), so its median falls on one kind
    or the other from run to run; the mean is the time per step over an interval."""
    q = statistics.quantiles(out["wall"], n=4) if len(out["wall"]) >= 4 else None
    out.update(row=row, median_s=statistics.median(out["wall"]),
               mean_s=statistics.fmean(out["wall"]),
               iqr=(q[0], q[2]) if q else (min(out["wall"]), max(out["wall"])))  # fmt: skip
    return out


def table(rows: list[dict]) -> str:
    """Ratios as median/mean (> 1: slower than the anchor)."""
    by = {r["row"]: r for r in rows if "error" not in r}
    lines = ["| row | s/step median | IQR | s/step mean | x offload | x DS zenflow | last loss |",
             "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['row']} | **error**: {r['error'].splitlines()[-1]} | | | | | |")
            continue
        ratio = [
            f"{r['median_s'] / by[a]['median_s']:.2f}/{r['mean_s'] / by[a]['mean_s']:.2f}"
            if a in by
            else "-"
            for a in ("offload", "deepspeed zenflow")
        ]
        lines.append(f"| {r['row']} | {r['median_s']:.4f} | {r['iqr'][0]:.4f}-{r['iqr'][1]:.4f} "
                     f"| {r['mean_s']:.4f} | {ratio[0]} | {ratio[1]} | {r['losses'][-1]:.4f} |")  # fmt: skip
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--micro", type=int, default=16, help="rows per batch")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--topk-ratio", type=float, default=0.05)
    p.add_argument("--select-interval", type=int, default=2)
    p.add_argument("--update-interval", type=int, default=2)
    p.add_argument("--overlap-step", type=int, choices=[0, 1], default=1)
    p.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    p.add_argument("--stage", type=int, choices=[1, 2, 3], default=2)
    p.add_argument("--offload-param", action="store_true", help="stage 3: offload_param cpu")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--timeout", type=float, default=600.0, help="per row (a hang guard)")
    p.add_argument("--quick", action="store_true", help="hidden 64 x 2 layers, 3+1 steps")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--in-process", action="store_true",
                   help="run the rows in this process, one after the other (not the DeepSpeed "
                   "row; the GPU check's short run: one interpreter start instead of one a row)")  # fmt: skip
    p.add_argument("--worker", choices=ROWS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # each row's process gets them
    if args.quick:
        args.hidden, args.layers, args.steps, args.warmup, args.micro = 64, 2, 3, 1, 4
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return 0
    if args.in_process and "deepspeed zenflow" in args.rows:
        raise SystemExit("--in-process: not with the deepspeed zenflow row (its own process)")
    run = in_process_row if args.in_process else run_row
    rows = [run(args, row) for row in args.rows]
    params = next((r["params"] for r in rows if "params" in r), 0)
    gpu = next((r["gpu"] for r in rows if r.get("gpu")), None)
    print(f"CPU: {cpu_kind()}, {args.threads} threads per run; torch {torch.__version__}"
          + (f"; device: {gpu}" if gpu else "; device: this CPU"))  # fmt: skip
    print(f"model: {args.layers} x Linear({args.hidden}, {args.hidden}) ({params / 1e6:.2f}M "
          f"params), micro batch {args.micro}, stage {args.stage} + offload_optimizer cpu"
          f"{' + offload_param cpu' if args.stage == 3 and args.offload_param else ''}, one rank; "
          f"zenflow {json.dumps(zenflow_block(args))}; median of {args.steps} steps after "
          f"{args.warmup}")  # fmt: skip
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
