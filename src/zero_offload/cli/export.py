"""``zero-offload export CKPT_DIR OUT_DIR``: consolidate a checkpoint into Hugging Face's
safetensors layout in ``OUT_DIR``: ``model.safetensors`` when the model fits in one shard
(``--max-shard-size``, transformers' default 50GB), else ``model-0000k-of-0000n.safetensors`` and
``model.safetensors.index.json``; streamed, one tensor in memory at a time. Trainable params come
from the fp32 masters, frozen params and buffers as saved. With ``--hf-config MODEL_DIR`` the
folder gets that model's ``config.json`` and loads with ``from_pretrained``; without it, the
weights alone (every key, a tied weight under each name: ``load_state_dict(strict=True)``)."""

from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "ckpt_dir", help="the save_dir given to save_checkpoint (or one tag directory in it)"
    )
    p.add_argument("out_dir", help="directory to write the weights into (created if missing)")
    p.add_argument("--tag", default=None, help="checkpoint tag (default: the one `latest` names)")
    p.add_argument(
        "--dtype",
        choices=["fp32", "bf16", "fp16"],
        default="fp32",
        help="dtype of floating tensors in the output (default fp32)",
    )
    p.add_argument(
        "--max-shard-size",
        default=None,
        help="largest shard, Hugging Face's syntax: '5GB', '500MB', '2GiB' or bytes (default "
        "50GB, transformers' save_pretrained default); a tensor larger than that is a shard alone",
    )
    p.add_argument(
        "--single-file",
        action="store_true",
        help="one safetensors file whatever the size (no index)",
    )
    p.add_argument(
        "--filename",
        default="model.safetensors",
        help="weights file name (default model.safetensors; shards are <stem>-0000k-of-0000n"
        ".safetensors and the index <filename>.index.json)",
    )
    p.add_argument(
        "--hf-config",
        metavar="MODEL_DIR",
        default=None,
        help="a Hugging Face model folder: copy its config.json (and generation_config.json) "
        "so OUT_DIR loads with from_pretrained; keys are checked against that model, tied "
        "weights written once as save_pretrained does",
    )
    p.add_argument(
        "--strip-prefix",
        metavar="PREFIX",
        default=None,
        help="remove PREFIX from every key ('model.' for a `train --model` checkpoint, whose "
        "module wraps the Hugging Face model)",
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

    from ..checkpoint import CheckpointError
    from ..checkpoint.export.consolidate import export_sharded
    from ..checkpoint.export.sharded import DEFAULT_MAX_SHARD_SIZE, parse_size

    if args.single_file and args.max_shard_size is not None:
        print("export: --single-file and --max-shard-size exclude each other", file=sys.stderr)
        return 2
    limit = None if args.single_file else (args.max_shard_size or DEFAULT_MAX_SHARD_SIZE)
    try:
        if limit is not None:
            parse_size(int(limit) if str(limit).isdigit() else limit)
    except ValueError as e:
        print(f"export: --max-shard-size: {e}", file=sys.stderr)
        return 2
    if limit is not None and str(limit).isdigit():
        limit = int(limit)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    t0 = time.perf_counter()
    try:
        result = export_sharded(
            args.ckpt_dir,
            Path(args.out_dir),
            tag=args.tag,
            dtype=dtype,
            exclude_frozen_parameters=args.exclude_frozen_parameters,
            max_shard_size=limit,
            weights_name=args.filename,
            strip_prefix=args.strip_prefix,
            hf_config=args.hf_config,
        )
    except (CheckpointError, OSError) as e:  # missing, damaged or mismatched: it says which
        print(f"export: {e}", file=sys.stderr)
        return 1
    except ImportError as e:  # --hf-config without transformers
        print(f"export: {e}", file=sys.stderr)
        return 1
    size = sum(f.stat().st_size for f in result.files)
    where = (
        f"{result.files[0]}"
        if result.index is None
        else f"{result.out_dir}: {len(result.files)} shards and {result.index.name}"
    )
    print(
        f"wrote {where}: {result.tensors} tensors, {result.total_size / 2**20:.1f} MiB of "
        f"weights ({args.dtype}), {size / 2**20:.1f} MiB on disk in {time.perf_counter() - t0:.2f}s"
    )
    if args.hf_config is None:
        print(
            "  weights only (no config.json): add --hf-config MODEL_DIR for a folder "
            "from_pretrained loads"
        )
    return 0
