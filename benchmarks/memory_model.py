"""Measured step peak against the memory model's prediction, and against DeepSpeed.

For GPT-2 sizes x placements (stage 2, stage 2 + offload_optimizer cpu, stage 3 + both offloads
cpu, stage 3 + both on NVMe), fp32, one rank on the CPU (where device and host are the same
memory): each run in a process of its own (``_memory_worker.py``) takes two steps, then measures a
third. Printed per row:

- predicted: ``engine.expected_memory(seq_length)``'s device plus host peak (states + working set);
- measured: the bytes of every tensor kept between steps plus the most the third step allocated
  above that (allocated bytes, as a GPU allocator counts them), and the ratio measured/predicted;
- RSS: the process's peak resident set above its size before the model was built;
- with ``--compare-deepspeed PYTHON``: the same config and model under DeepSpeed (run by that
  interpreter, a separate environment with DeepSpeed installed), its measured peak and RSS, and
  ours/DeepSpeed's.

Usage: ``python benchmarks/memory_model.py [--sizes small,medium,large] [--placements ...]
[--compare-deepspeed /path/to/venv/bin/python] [--nvme-dir DIR]``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
GIB = 2**30
SIZES = {  # layers, hidden, heads
    "small": (2, 256, 4),
    "medium": (4, 512, 8),
    "large": (8, 768, 12),
}
VOCAB, SEQ, MICRO = 8192, 256, 2
PLACEMENTS = ("stage2", "stage2-cpu", "stage3-cpu", "stage3-nvme")


def zero_config(placement: str, nvme: str) -> dict:
    zero: dict = {"stage": 2, "reduce_bucket_size": 2_000_000, "overlap_comm": True,
                  "contiguous_gradients": True}  # fmt: skip
    if placement == "stage2-cpu":
        zero["offload_optimizer"] = {"device": "cpu"}
    if placement.startswith("stage3"):
        dev = "nvme" if placement == "stage3-nvme" else "cpu"
        extra = {"nvme_path": nvme} if dev == "nvme" else {}
        zero.update(stage=3, stage3_max_live_parameters=4_000_000,
                    stage3_prefetch_bucket_size=2_000_000,
                    stage3_param_persistence_threshold=10_000,
                    offload_optimizer={"device": dev, **extra},
                    offload_param={"device": dev, **extra})  # fmt: skip
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_one(python: str, spec: dict, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        sp, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        sp.write_text(json.dumps(spec))
        env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
               "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_port()),
               "PYTHONWARNINGS": "ignore"}  # fmt: skip
        try:
            done = subprocess.run([python, str(HERE / "_memory_worker.py"), str(sp), str(out)],
                                  capture_output=True, text=True, timeout=timeout, env=env)  # fmt: skip
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        if done.returncode != 0 or not out.exists():
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            return {"error": last[:160]}
        return json.loads(out.read_text())


def row(size: str, placement: str, args) -> dict:
    layers, hidden, heads = SIZES[size]
    spec = {"layers": layers, "hidden": hidden, "heads": heads, "vocab": VOCAB, "seq": SEQ,
            "micro": MICRO, "ckpt": False, "config": zero_config(placement, args.nvme_dir)}  # fmt: skip
    out = {"size": size, "placement": placement}
    ours = run_one(sys.executable, {**spec, "impl": "engine"}, args.timeout)
    out["ours"] = ours
    if args.compare_deepspeed:
        out["deepspeed"] = run_one(args.compare_deepspeed, {**spec, "impl": "deepspeed"},
                                   args.timeout)  # fmt: skip
    return out


def measured(r: dict) -> float:
    return (r["states"] + r["working"]) / GIB


def print_row(r: dict) -> None:
    ours = r["ours"]
    head = f"{r['size']:<7} {r['placement']:<12}"
    if "error" in ours:
        print(f"{head} error: {ours['error']}")
        return
    pred = ours["predicted"]
    predicted = (pred["peak.device.total"] + pred["peak.host.total"]) / GIB
    line = (f"{head} {predicted:>9.3f} {measured(ours):>9.3f} {measured(ours) / predicted:>6.3f} "
            f"{ours['working'] / GIB:>8.3f} {(ours['rss_peak'] - ours['rss_base']) / GIB:>8.3f}")  # fmt: skip
    ds = r.get("deepspeed")
    if ds is not None and "error" in ds:
        line += f"   deepspeed error: {ds['error']}"
    elif ds is not None:
        rss = (ds["rss_peak"] - ds["rss_base"]) / GIB
        ours_rss = (ours["rss_peak"] - ours["rss_base"]) / GIB
        line += (f" {measured(ds):>9.3f} {ds['working'] / GIB:>8.3f} {rss:>8.3f} "
                 f"{measured(ours) / measured(ds):>6.3f} {ours_rss / rss:>6.3f}")  # fmt: skip
    print(line, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default=",".join(SIZES))
    p.add_argument("--placements", default=",".join(PLACEMENTS))
    p.add_argument("--compare-deepspeed", metavar="PYTHON",
                   help="an interpreter whose environment has DeepSpeed 0.19.8")  # fmt: skip
    p.add_argument("--nvme-dir", default=None, help="folder for the NVMe swap files")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    tmp = None
    if args.nvme_dir is None:
        tmp = tempfile.TemporaryDirectory(dir=os.getcwd())
        args.nvme_dir = tmp.name
    print(f"GPT-2, vocab {VOCAB}, seq {SEQ}, micro batch {MICRO}, fp32, 1 rank on the CPU; GiB")
    cols = f"{'size':<7} {'placement':<12} {'predicted':>9} {'measured':>9} {'ratio':>6} {'step':>8} {'rss':>8}"
    if args.compare_deepspeed:
        cols += f" {'ds meas.':>9} {'ds step':>8} {'ds rss':>8} {'ours/ds':>6} {'rss/ds':>6}"
    print(cols)
    rows = []
    for size in args.sizes.split(","):
        for placement in args.placements.split(","):
            rows.append(row(size, placement, args))
            print_row(rows[-1])
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
