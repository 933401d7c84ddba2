"""On-disk names, the metadata schema version, and the checkpoint errors.

A checkpoint is a directory ``<save_dir>/<tag>/`` holding ``meta.json`` (everything that is not a
tensor, plus a digest of every other file), ``model.safetensors`` (the module state dict, written
once by rank 0) and one ``rank_XXXXX.safetensors`` per rank (its master shard, optimizer state and
RNG states). See docs/checkpoints.md for the full layout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FORMAT = "zero_offload.checkpoint"
FORMAT_VERSION = 1

META_FILE = "meta.json"
MODEL_FILE = "model.safetensors"
LATEST_FILE = "latest"
SHARD_KINDS = ("master", "exp_avg", "exp_avg_sq")  # fp32, all laid out in the same shard order
RNG_TORCH, RNG_CUDA = "rng.torch_cpu", "rng.cuda"
RANK_META_KEY = "zero_offload.rank"  # safetensors __metadata__ key of a rank file's JSON


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or loaded as asked; the message names file and tensor."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A tag, a ``latest`` target or a file of the checkpoint is missing."""


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def shard_tensor(group: int, kind: str) -> str:
    return f"group{group}.{kind}"


def check_tag(tag: str) -> str:
    """A tag names one directory entry of ``save_dir``; dot names are the writer's own."""
    if not isinstance(tag, str) or not tag:
        raise CheckpointError(f"tag must be a non-empty string, got {tag!r}")
    if "/" in tag or "\\" in tag or tag.startswith(".") or tag == LATEST_FILE or "\0" in tag:
        raise CheckpointError(
            f"tag {tag!r} is not allowed: it must be one path component that does not start "
            f"with '.' and is not {LATEST_FILE!r}"
        )
    return tag


def json_value(value: Any, where: str) -> Any:
    """``value`` as plain JSON data (tuples become lists), or an error naming the bad entry.

    Checkpoint metadata is JSON so that loading never unpickles anything; a value that JSON
    cannot carry is refused at save time rather than silently changed.
    """
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)  # NaN and infinities travel as JSON's NaN/Infinity extension
    if isinstance(value, list | tuple):
        return [json_value(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise CheckpointError(
                    f"{where}: key {k!r} of type {type(k).__name__} is not a string; checkpoint "
                    "metadata is JSON, whose object keys are strings"
                )
            out[k] = json_value(v, f"{where}[{k!r}]")
        return out
    hint = " (convert tensors with .tolist() or .item())" if hasattr(value, "tolist") else ""
    raise CheckpointError(
        f"{where}: value of type {type(value).__name__} is not JSON-serializable{hint}; "
        "allowed: dict (str keys), list, tuple, str, int, float, bool, None"
    )


def read_json(path: Path) -> Any:
    """Parse a JSON file of the checkpoint, naming the file when it is missing or damaged."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path}: file is missing") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e}); the file is damaged") from None


def require(meta: dict, key: str, where: str) -> Any:
    if not isinstance(meta, dict) or key not in meta:
        raise CheckpointError(f"{where}: required key {key!r} is missing")
    return meta[key]
