"""``zero-offload export CKPT_DIR OUT_DIR``: consolidate a checkpoint into ``OUT_DIR/model.safetensors``,
one plain state dict that ``model.load_state_dict(safetensors.torch.load_file(...))`` accepts
(trainable params from the fp32 masters, frozen params and buffers as saved)."""

from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "ckpt_dir", help="the save_dir given to save_checkpoint (or one tag directory in it)"
    )
    p.add_argument("out_dir", help="directory to write model.safetensors into (created if missing)")
    p.add_argument("--tag", default=None, help="checkpoint tag (default: the one `latest` names)")
    p.add_argument(
        "--dtype",
        choices=["fp32", "bf16", "fp16"],
        default="fp32",
        help="dtype of floating tensors in the output (default fp32)",
    )
    p.add_argument(
        "--filename",
        default="model.safetensors",
        help="output file name (default model.safetensors)",
    )
    p.add_argument(
        "--exclude-frozen-parameters",
        action="store_true",
        help="leave out parameters with requires_grad=False",
    )


def run(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    import torch

    from ..checkpoint import CheckpointError, export_safetensors
    from ..checkpoint.tensor_file import read_header

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    t0 = time.perf_counter()
    try:
        out = export_safetensors(
            args.ckpt_dir,
            Path(args.out_dir) / args.filename,
            tag=args.tag,
            dtype=dtype,
            exclude_frozen_parameters=args.exclude_frozen_parameters,
        )
    except (CheckpointError, OSError) as e:  # missing, damaged or mismatched: it says which
        print(f"export: {e}", file=sys.stderr)
        return 1
    header = read_header(out)
    numel = sum(_numel(t.shape) for t in header.tensors.values())
    print(
        f"wrote {out}: {len(header.tensors)} tensors, {numel / 1e6:.2f}M elements, "
        f"{out.stat().st_size / 2**20:.1f} MiB ({args.dtype}) in {time.perf_counter() - t0:.2f}s"
    )
    return 0


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
