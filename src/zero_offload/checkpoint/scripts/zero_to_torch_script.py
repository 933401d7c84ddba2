#!/usr/bin/env python
"""zero_to_torch.py: consolidate a zero_offload checkpoint into float32, float16 or bfloat16
weights.

Every ``engine.save_checkpoint(save_dir)`` puts this script beside ``zero_to_fp32.py`` (as
DeepSpeed puts its own two there), and it reads the checkpoint through that sibling. It needs
only torch and safetensors, and takes DeepSpeed 0.19.8's arguments::

    python zero_to_torch.py CHECKPOINT_DIR OUTPUT_DIR --dtype {bf16,bfloat16,float16,float32,
        fp16,fp32} [-t TAG] [--max_shard_size 5GB] [--safe_serialization]
        [--exclude_frozen_parameters]

The weights are ``zero_to_fp32.py``'s (the fp32 master weights of trainable params, frozen
params and buffers as saved) with every floating tensor cast to ``--dtype`` (integer buffers keep
theirs), written as that script writes them (``pytorch_model.bin`` or ``model.safetensors``,
split past ``--max_shard_size`` with Hugging Face's index).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

if __package__:
    from . import zero_to_fp32_script as zero_to_fp32
else:  # the sibling script in the checkpoint folder, also when run through runpy.run_path
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import zero_to_fp32

OUTPUT_DTYPE_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_dtype(dtype) -> torch.dtype:
    """A dtype given as a torch dtype or one of OUTPUT_DTYPE_NAMES (``"torch."`` prefix allowed)."""
    name = dtype
    if isinstance(dtype, str):
        dtype = OUTPUT_DTYPE_NAMES.get(dtype.removeprefix("torch.").lower())
    if dtype not in OUTPUT_DTYPE_NAMES.values():
        allowed = ", ".join(sorted(OUTPUT_DTYPE_NAMES))
        raise ValueError(f"dtype: unsupported output dtype {name!r}; allowed: {allowed}")
    return dtype


def cast_state_dict(state: dict, dtype: torch.dtype, safe: bool) -> dict:
    """Floating tensors cast to ``dtype``; tied keys keep one tensor (a copy each for
    safetensors, which stores no shared tensors)."""
    out: dict[str, torch.Tensor] = {}
    done: dict[int, torch.Tensor] = {}
    for key, tensor in state.items():
        cast = done.get(id(tensor))
        if cast is None:
            cast = tensor.to(dtype) if tensor.is_floating_point() else tensor
            done[id(tensor)] = cast
        elif safe:
            cast = cast.clone()
        out[key] = cast
    return out


def _write_index(out: Path, weights: str, names: list[str], shards: list, total: int) -> Path:
    index = {
        "metadata": {"total_size": total},
        "weight_map": {key: name for name, keys in zip(names, shards) for key in keys},
    }
    path = out / f"{weights}.index.json"
    tmp = out / f".{path.name}.tmp.{os.getpid()}"
    tmp.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def convert_zero_checkpoint_to_state_dict(
    checkpoint_dir,
    output_dir,
    dtype=torch.float32,
    max_shard_size="5GB",
    safe_serialization=False,
    tag=None,
    exclude_frozen_parameters=False,
) -> list[Path]:
    """DeepSpeed 0.19.8's function: the consolidated weights in ``dtype`` into ``output_dir``,
    sharded past ``max_shard_size`` (None: one file). Returns the files written (index last)."""
    dtype = resolve_dtype(dtype)
    fp32 = zero_to_fp32.get_fp32_state_dict(checkpoint_dir, tag, exclude_frozen_parameters)
    state = cast_state_dict(fp32, dtype, safe_serialization)
    del fp32
    specs = [(key, t.numel() * t.element_size()) for key, t in state.items()]
    shards = zero_to_fp32._split(specs, zero_to_fp32.parse_size(max_shard_size))
    weights = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    names = zero_to_fp32._shard_names(weights, len(shards))
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, keys in zip(names, shards):
        zero_to_fp32._write(out / name, {k: state[k] for k in keys}, safe_serialization)
        written.append(out / name)
    if len(names) > 1:
        written.append(_write_index(out, weights, names, shards, sum(n for _, n in specs)))
    return written


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint_dir", help="the checkpoint folder (holding 'latest')")
    parser.add_argument("output_dir", help="where the weights go")
    parser.add_argument(
        "--dtype", required=True, choices=sorted(OUTPUT_DTYPE_NAMES), help="output tensor dtype"
    )
    parser.add_argument("--max_shard_size", default="5GB", help="5GB, 500MB, 2GiB or bytes")
    parser.add_argument("--safe_serialization", action="store_true", help="write safetensors")
    parser.add_argument("-t", "--tag", default=None, help="the checkpoint tag (default: latest's)")
    parser.add_argument("--exclude_frozen_parameters", action="store_true")
    parser.add_argument("-d", "--debug", action="store_true", help="accepted, as DeepSpeed's")
    args = parser.parse_args(argv)
    files = convert_zero_checkpoint_to_state_dict(
        args.checkpoint_dir,
        args.output_dir,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        safe_serialization=args.safe_serialization,
        tag=args.tag,
        exclude_frozen_parameters=args.exclude_frozen_parameters,
    )
    for path in files:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
