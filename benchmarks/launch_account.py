"""Every host byte of a 2-rank ``zero-offload launch ... train --model`` run, per rank: the peak
anonymous RSS of each rank's process against the engine's memory report by term.

A Llama (default 12 x 1024, vocab 32000: 220M params) saved as bf16 safetensors in a temporary
folder is fine-tuned by the ``train`` command as a user runs it, fp32 training, stage 3 with both
offloads "cpu", ``reduce_bucket_size`` and ``stage3_max_live_parameters`` 1e7, micro batch 1,
sequence 32:

    zero-offload launch --num_gpus 2 --module zero_offload.cli.main train --model DIR \\
        --config cfg.json --steps 3 --seq-length 32 --batch-size 1 --out OUT

Each rank's anonymous RSS (what it allocated; file pages not counted) is sampled every 20 ms
from outside. The terms are rank 0's ``memory`` in ``run.json`` (the engine's states, the steps'
peaks, malloc's free heap) plus the anonymous RSS of a process that only imported what a rank
imports (the baseline of an import); on a CPU the ``device.*`` terms are host memory too.

    python benchmarks/launch_account.py [--hidden 1024 --layers 12 --steps 3]

It ends with each rank's peak against its states (the terms that are no step's peak) and
malloc's free heap (``peak.host.allocator_free``), the free-heap table of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import host_account  # noqa: E402

MIB = 2**20
GIB = 2**30
IMPORTS = "import torch, transformers, zero_offload, zero_offload.cli.main, zero_offload.hf"


def _anon(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(x.split()[1]) * 1024 for x in f if x.startswith("RssAnon:"))
    except (OSError, StopIteration):
        return 0


def _heap_rss(pid: int) -> int:
    """Resident bytes of the process's main malloc heap (``[heap]`` in its smaps)."""
    try:
        with open(f"/proc/{pid}/smaps") as f:
            in_heap = False
            for line in f:
                if line[0] in "0123456789abcdef" and "-" in line.split()[0]:
                    in_heap = line.rstrip().endswith("[heap]")
                elif in_heap and line.startswith("Rss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _rank_of(pid: int) -> int | None:
    """The RANK of a launched process running the train command (None for anything else)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"zero_offload.cli.main" not in cmd or b"launch" in cmd:
            return None
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [int(e[5:]) for e in env if e.startswith(b"RANK=")]
    return ranks[0] if ranks else None


class RankPeaks:
    """The peak anonymous RSS of every rank process, sampled while the launch runs."""

    def __init__(self) -> None:
        self.peak: dict[int, int] = {}
        self.heap: dict[int, int] = {}  # peak resident main heap, sampled every 10th round
        self.pids: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        rounds = 0
        while not self._stop.is_set():
            for d in os.listdir("/proc"):
                if not d.isdigit():
                    continue
                pid = int(d)
                if pid not in self.pids.values():
                    rank = _rank_of(pid)
                    if rank is None or rank in self.pids:
                        continue
                    self.pids[rank] = pid
            rounds += 1
            for rank, pid in self.pids.items():
                self.peak[rank] = max(self.peak.get(rank, 0), _anon(pid))
                if rounds % 10 == 0:
                    self.heap[rank] = max(self.heap.get(rank, 0), _heap_rss(pid))
            time.sleep(0.02)

    def __enter__(self) -> RankPeaks:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def import_baseline() -> int:
    code = f"{IMPORTS}\nfor l in open('/proc/self/status'):\n    l.startswith('RssAnon:') and print(l.split()[1])"  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1]) * 1024


def save_model(args, folder: str) -> int:
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(host_account._llama(args)).to(torch.bfloat16)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    from zero_offload.kernels.bench import _cpu_name

    with tempfile.TemporaryDirectory() as tmp:
        model_dir, out = os.path.join(tmp, "model"), os.path.join(tmp, "run")
        n = save_model(args, model_dir)
        cfg = host_account.config(1e7, 1e7) | {"train_batch_size": args.world}
        Path(tmp, "cfg.json").write_text(json.dumps(cfg))
        cmd = [sys.executable, "-m", "zero_offload.cli.main", "launch", "--num_gpus",
               str(args.world), "--module", "zero_offload.cli.main", "train", "--model", model_dir,
               "--config", os.path.join(tmp, "cfg.json"), "--steps", str(args.steps),
               "--seq-length", str(args.seq), "--batch-size", "1", "--out", out,
               "--log-every", "0", "--eval-batches", "1"]  # fmt: skip
        print(f"CPU: {_cpu_name()} ({os.cpu_count()} cores); Llama {args.layers} x "
              f"{args.hidden}, {n / 1e6:.1f}M params, bf16 safetensors; fp32 training, stage 3 "
              f"+ both offloads cpu, {args.world} ranks, {args.steps} steps of {args.seq} tokens")  # fmt: skip
        print("$ zero-offload " + " ".join(cmd[3:]))
        with RankPeaks() as peaks:
            p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            sys.exit(f"train failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
        print("\n".join(x for x in p.stdout.splitlines() if x.startswith("memory")))
        report = json.loads(Path(out, "run.json").read_text())["memory"]
    base = import_baseline()
    terms = sum(report.values()) + base
    print("| term (rank 0) | MiB |\n| --- | --- |")
    for k, v in sorted(report.items(), key=lambda kv: (kv[0].startswith("peak."), kv[0])):
        print(f"| {k} | {v / MIB:.1f} |")
    print(f"| baseline of an import | {base / MIB:.1f} |\n| sum of the terms | {terms / MIB:.1f} |")
    for rank in sorted(peaks.peak):
        m = peaks.peak[rank]
        print(f"rank {rank}: peak anonymous RSS {m / MIB:.1f} MiB; terms / measured "
              f"{terms / m:.3f}")  # fmt: skip
    # The states against the peak, side by side: what a rank keeps for the run (every term but
    # the steps' peaks), malloc's free heap (the most glibc counted free in its heaps at a
    # step's samples; pages handed back by malloc_trim are counted too) and the main heap's
    # resident bytes (live and free blocks alike), the most sampled.
    states = sum(v for k, v in report.items() if not k.startswith("peak."))
    free = report.get("peak.host.allocator_free", 0)
    print("| rank | peak anonymous RSS (GiB) | states (GiB) | peak / states | free heap, "
          "glibc's count (GiB) | resident main heap (GiB) |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- |")
    for rank in sorted(peaks.peak):
        m = peaks.peak[rank]
        print(f"| {rank} | {m / GIB:.2f} | {states / GIB:.2f} | {m / states:.2f}x | "
              f"{free / GIB:.2f} (rank 0) | {peaks.heap.get(rank, 0) / GIB:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
