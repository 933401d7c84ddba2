"""Peak host memory of `zero-offload export`: the single file as it was written before the
streamed export (memory-mapped reads, hashing writer), and today's single file and sharded
layouts, each run in a fresh process.

A GPT-2 (default 24 x 1024, vocab 50257: 354.8M params, the size issue 19 quotes) is trained one
step with ZeRO stage 2 + optimizer offload in bf16 and checkpointed (in a subprocess, so its memory
is gone before the exports run). Then, per mode, a child process imports torch and zero_offload,
measures its baseline (VmRSS and RssAnon), runs the export to fp32 while a thread samples
/proc/self/status every 5 ms, and reports the peak above that baseline: RSS (includes file pages
mapped while reading) and anonymous RSS (what the process allocated), plus ru_maxrss minus the
baseline. Linux only.

    python benchmarks/export_memory.py                         # 355M, ~2-3 minutes on 2 cores
    python benchmarks/export_memory.py --layers 12 --hidden 768 --heads 12   # 124M
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GIB = 2**30


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checkpoint_io import PeakMemory  # noqa: E402


# ---- the checkpoint ----------------------------------------------------------------------------
def make_checkpoint(args) -> None:
    import torch

    import zero_offload
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
    ds = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "steps_per_print": 10**9,
    }
    if args.dtype != "fp32":
        ds[args.dtype] = {"enabled": True}
    engine, *_ = zero_offload.initialize(model=model, config=ds)
    x = torch.randint(0, args.vocab, (1, 16), device=engine.device)
    loss = engine(x, x)
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(args.ckpt)
    numel = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters())
    Path(args.ckpt, "bench.json").write_text(json.dumps({"params": numel, "largest": largest}))


# ---- one export, in a child --------------------------------------------------------------------
def _legacy_export(ckpt_dir: str, out_path: Path) -> None:
    """The export as it was before the streamed one (2026-11-24): tensors read through
    safetensors' memory map (``CheckpointReader.read_slice`` / ``read_tensor``), written by the
    checkpoint writer (which also hashes every 64 MiB block)."""
    import torch

    from zero_offload.checkpoint.export import consolidate as ex
    from zero_offload.checkpoint.tensor_file import write_file

    def mmap_read_into(ckpt, name, lo, hi, out, tensor):
        header = ckpt.header(name)
        start = header.data_start + header.tensors[tensor].begin
        a, b = (lo - start) // out.element_size(), (hi - start) // out.element_size()
        if name == ex.MODEL_FILE:
            out.copy_(ckpt.read_tensor(name, tensor).reshape(-1)[a:b])
        else:
            out.copy_(ckpt.read_slice(name, tensor, a, b))

    ex._read_into = mmap_read_into
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with ex._open(ckpt_dir, None) as ckpt:
        entries = ex._entries(ckpt, torch.float32, False)
        tmp = out_path.with_name(f".{out_path.name}.tmp")
        write_file(tmp, entries, {"format": "pt"})
        os.replace(tmp, out_path)


def child(mode: str, ckpt: str, out: str) -> None:
    import gc

    import torch  # noqa: F401 - part of the baseline, as in the CLI

    from zero_offload.cli.main import main as cli

    gc.collect()
    t0 = time.perf_counter()
    with PeakMemory() as s:
        if mode == "legacy":
            _legacy_export(ckpt, Path(out) / "model.safetensors")
        else:
            flags = ["--single-file"] if mode == "single" else ["--max-shard-size", mode]
            with open(os.devnull, "w") as devnull:
                stdout, sys.stdout = sys.stdout, devnull
                try:
                    rc = cli(["export", ckpt, out, *flags])
                finally:
                    sys.stdout = stdout
            assert rc == 0, rc
    seconds = time.perf_counter() - t0
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    files = [p for p in Path(out).iterdir() if p.name.endswith(".safetensors")]
    print(
        json.dumps(
            {
                "mode": mode,
                "seconds": seconds,
                "base_rss": s.base[0],
                "base_anon": s.base[1],
                "peak_rss": s.peak[0],
                "peak_anon": s.peak[1],
                "maxrss": maxrss,
                "files": len(files),
                "bytes": sum(p.stat().st_size for p in files),
            }
        )
    )


# ---- driver ------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument(
        "--modes",
        nargs="+",
        default=["legacy", "single", "500MB", "200MB"],
        help="legacy (before streaming), single (--single-file), or a --max-shard-size",
    )
    ap.add_argument("--dir", default=None, help="work folder (default: a temporary one)")
    ap.add_argument("--child", nargs=3, metavar=("MODE", "CKPT", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--make-checkpoint", dest="ckpt", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return 0
    if args.ckpt:
        make_checkpoint(args)
        return 0

    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="export-mem-"))
    root.mkdir(parents=True, exist_ok=True)
    ckpt = root / "ckpt"
    me = [sys.executable, os.path.abspath(__file__)]
    shape = ["--layers", str(args.layers), "--hidden", str(args.hidden)]
    shape += ["--heads", str(args.heads), "--vocab", str(args.vocab), "--seq", str(args.seq)]
    t0 = time.perf_counter()
    subprocess.run([*me, *shape, "--dtype", args.dtype, "--make-checkpoint", str(ckpt)], check=True)
    info = json.loads((ckpt / "bench.json").read_text())
    print(
        f"checkpoint: {info['params'] / 1e6:.1f}M params ({args.dtype} training), "
        f"{sum(p.stat().st_size for p in ckpt.rglob('*') if p.is_file()) / GIB:.2f} GiB, "
        f"made in {time.perf_counter() - t0:.0f}s; largest tensor {info['largest'] * 4 / 2**20:.0f}"
        " MiB in fp32",
        flush=True,
    )
    rows = []
    for mode in args.modes:
        out = root / f"out-{mode}"
        shutil.rmtree(out, ignore_errors=True)
        done = subprocess.run(
            [*me, "--child", mode, str(ckpt), str(out)],
            check=True,
            capture_output=True,
            text=True,
        )
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        shutil.rmtree(out, ignore_errors=True)
    ref = next((r for r in rows if r["mode"] == "legacy"), rows[0])
    print()
    print(
        "| export (fp32) | files | seconds | peak RSS above baseline | peak anonymous RSS "
        "above baseline | ru_maxrss above baseline | RSS vs legacy |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    names = {"legacy": "single file, before (mmap reads)", "single": "single file (--single-file)"}
    for r in rows:
        rss = r["peak_rss"] - r["base_rss"]
        anon = r["peak_anon"] - r["base_anon"]
        maxrss = r["maxrss"] - r["base_rss"]
        ratio = rss / max(1, ref["peak_rss"] - ref["base_rss"])
        name = names.get(r["mode"], f"sharded, --max-shard-size {r['mode']}")
        print(
            f"| {name} | {r['files']} | {r['seconds']:.1f} | {rss / GIB:.2f} GiB | "
            f"{anon / GIB:.2f} GiB | {maxrss / GIB:.2f} GiB | {ratio:.2f} |"
        )
    print(f"\nbaseline (python + torch + zero_offload): {ref['base_rss'] / GIB:.2f} GiB RSS")
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
