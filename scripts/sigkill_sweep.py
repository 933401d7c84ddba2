"""Opt-in sweep: SIGKILL a process at random instants while it saves checkpoints, then check
that what it leaves always loads (``latest`` and every published tag), naming any failure.

    python scripts/sigkill_sweep.py [--runs 30] [--max-delay 3.0]

Each run starts a child that saves ``first``, then saves new tags in a loop; the parent kills it
after a random delay, then loads ``latest`` and each published tag into a fresh engine. Exit
status 0 when every run left loadable checkpoints.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
}


def build():
    import torch

    import zero_offload

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 512))
    engine, _, _, _ = zero_offload.initialize(model=model, config=CONFIG)
    return engine


def child(root: str) -> None:
    import torch

    engine = build()

    def step() -> None:
        engine.backward(engine(torch.randn(2, 512)).pow(2).mean())
        engine.step()

    step()
    engine.save_checkpoint(root, tag="first")
    print("first saved", flush=True)
    i = 0
    while True:
        step()
        engine.save_checkpoint(root, tag=f"t{i % 3}")  # replacing tags exercises the swap too
        i += 1


def check(root: Path) -> list[str]:
    problems = []
    tags = [p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    for tag in [None, *sorted(tags)]:
        engine = build()
        try:
            path, _ = engine.load_checkpoint(str(root), tag=tag)
            if path is None:
                problems.append(f"{root}: tag {tag or 'latest'} loaded nothing")
        except Exception as e:  # noqa: BLE001 - every failure is reported
            problems.append(f"{root}: tag {tag or 'latest'}: {type(e).__name__}: {e}")
        engine.destroy()
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--max-delay", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    failures = 0
    for run in range(args.runs):
        root = Path(tempfile.mkdtemp(prefix="sigkill_sweep_"))
        proc = subprocess.Popen(
            [sys.executable, __file__, "--child", str(root)],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "first saved":
            print(f"run {run}: the child failed before its first save")
            failures += 1
            continue
        time.sleep(rng.uniform(0, args.max_delay))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        problems = check(root)
        failures += bool(problems)
        print(f"run {run}: {'ok' if not problems else 'FAILED'}", *problems, sep="\n  ")
    print(f"sigkill sweep: {args.runs} kills during saves, {failures} left a bad checkpoint")
    return 1 if failures else 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(sys.argv[2])
    else:
        sys.exit(main())
