"""Checkpoint save / load / export time and host memory for a GPT-2 trained with ZeRO stage 2 and
optimizer offload on one rank.

Each operation runs ``--reps`` times; the table reports the median wall time, the bytes it moved
divided by that time, and the peak host memory above the level just before it: RSS (includes
file pages mapped while reading) and anonymous RSS (memory the process allocated; what streaming
is meant to keep small). A sampling thread reads /proc/self/status every 5 ms (Linux).

The anchor row (``--anchor``) saves and loads the same tensors with ``torch.save``/``torch.load``
into one file, the usual way (a host copy of every device tensor, no checksums, no atomicity).

Loads read what the save just wrote, normally from the page cache; ``--cold`` drops the page cache
before each load (needs root; affects the whole machine).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path


class PeakMemory:
    """Peak RSS and anonymous RSS (bytes) above the level at entry, sampled on a thread."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval

    @staticmethod
    def read() -> tuple[int, int]:
        rss = anon = 0
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith("RssAnon:"):
                    anon = int(line.split()[1]) * 1024
        return rss, anon

    def __enter__(self) -> PeakMemory:
        self.base = self.read()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            rss, anon = self.read()
            self.peak = (max(self.peak[0], rss), max(self.peak[1], anon))
            time.sleep(self.interval)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        rss, anon = self.read()
        self.peak = (max(self.peak[0], rss), max(self.peak[1], anon))

    @property
    def delta(self) -> tuple[int, int]:
        return self.peak[0] - self.base[0], self.peak[1] - self.base[1]


def _drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--anchor", action="store_true", help="also time torch.save / torch.load")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before each load")
    args = ap.parse_args()

    import torch

    import zero_offload
    from zero_offload.checkpoint import export_safetensors
    from zero_offload.models.gpt2 import GPT2Config, GPT2Model

    torch.manual_seed(0)
    cfg = GPT2Config(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        seq_length=args.seq,
        vocab_size=args.vocab,
    )
    model = GPT2Model(cfg)
    numel = sum(p.numel() for p in model.parameters())
    ds = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "steps_per_print": 10**9,
    }
    if args.dtype != "fp32":
        ds[args.dtype] = {"enabled": True}
    engine, _, _, _ = zero_offload.initialize(model=model, config=ds)
    x = torch.randint(0, args.vocab, (1, 16), device=engine.device)
    loss = engine(x, x)  # one step, so the optimizer state is not all zeros
    engine.backward(loss)
    engine.step()

    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="ckpt-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    out = root / "export" / "model.safetensors"
    anchor = root / "anchor.pt"

    def save(rep: int) -> None:
        shutil.rmtree(root / f"t{rep}", ignore_errors=True)
        engine.save_checkpoint(str(root), tag=f"t{rep}")

    def tsave(_rep: int) -> None:
        so = engine.opt_groups[0].optimizer
        state = {
            "module": {k: v.detach().cpu().clone() for k, v in engine.module.state_dict().items()},
            "master": so.master,
            "exp_avg": so.exp_avg,
            "exp_avg_sq": so.exp_avg_sq,
        }
        torch.save(state, anchor)
        os.sync()

    def cold() -> None:
        if args.cold:
            _drop_caches()

    # (name, run(rep), bytes moved(rep), cold-cache candidate). One round runs every operation
    # once, in this order; rounds repeat, so machine noise hits all operations alike.
    ops = [
        ("save_checkpoint", save, lambda rep: _dir_bytes(root / f"t{rep}"), False),
        (
            "load_checkpoint",
            lambda rep: engine.load_checkpoint(str(root), tag=f"t{rep}"),
            lambda rep: _dir_bytes(root / f"t{rep}"),
            True,
        ),
        (
            "export fp32 (CLI path)",
            lambda rep: export_safetensors(root, out, tag=f"t{rep}"),
            lambda rep: out.stat().st_size,
            False,
        ),
    ]
    if args.anchor:
        ops += [
            ("anchor torch.save (+sync)", tsave, lambda rep: anchor.stat().st_size, False),
            (
                "anchor torch.load",
                lambda rep: torch.load(anchor, weights_only=True),
                lambda rep: anchor.stat().st_size,
                True,
            ),
        ]
    times: dict[str, list[float]] = {name: [] for name, *_ in ops}
    peaks: dict[str, list[tuple[int, int]]] = {name: [] for name, *_ in ops}
    nbytes: dict[str, int] = {}
    for rep in range(args.reps):
        for name, fn, bytes_of, is_load in ops:
            if is_load:
                cold()
            with PeakMemory() as mem:
                t0 = time.perf_counter()
                fn(rep)
                times[name].append(time.perf_counter() - t0)
            peaks[name].append(mem.delta)
            nbytes[name] = bytes_of(rep)
        shutil.rmtree(root / f"t{rep}", ignore_errors=True)
        print(
            f"  round {rep}: " + ", ".join(f"{n} {t[-1]:.2f}s" for n, t in times.items()),
            file=sys.stderr,
            flush=True,
        )
    rows = []
    for name in times:
        med = statistics.median(times[name])
        rows.append(
            (
                name,
                med,
                min(times[name]),
                nbytes[name] / med / 1e9,
                max(p[0] for p in peaks[name]) / 2**30,
                max(p[1] for p in peaks[name]) / 2**30,
                nbytes[name] / 2**30,
            )
        )

    so = engine.opt_groups[0].optimizer
    host_state = (so.master.numel() + so.exp_avg.numel() + so.exp_avg_sq.numel()) * 4
    print(
        f"GPT-2 {args.layers}x{args.hidden} vocab {args.vocab}: {numel / 1e6:.1f}M params, {args.dtype}, "
        f"ZeRO stage 2 + offload, world 1; host optimizer state {host_state / 2**30:.2f} GiB; "
        f"torch {torch.__version__}, {os.cpu_count()} CPUs; median of {args.reps}; "
        f"{'cold' if args.cold else 'warm'} page cache for loads; dir {root}"
    )
    print(
        f"| {'operation':<26} | {'median s':>8} | {'min s':>7} | {'GB/s':>6} | {'peak RSS +GiB':>13} | "
        f"{'peak anon +GiB':>14} | {'data GiB':>8} |"
    )
    print(f"|{'-' * 28}|{'-' * 10}|{'-' * 9}|{'-' * 8}|{'-' * 15}|{'-' * 16}|{'-' * 10}|")
    for name, med, mn, gbps, rss, anon, gib in rows:
        print(
            f"| {name:<26} | {med:>8.2f} | {mn:>7.2f} | {gbps:>6.2f} | {rss:>13.2f} | {anon:>14.2f} | {gib:>8.2f} |"
        )
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    engine.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
