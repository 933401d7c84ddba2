"""On-disk names, the metadata schema version, and the checkpoint errors.

A checkpoint is a directory ``<save_dir>/<tag>/`` holding ``meta.json`` (everything that is not a
tensor, plus a digest of every other file), ``model.safetensors`` (the module state dict, written
once by rank 0) and one ``rank_XXXXX.safetensors`` per rank (its master shard, optimizer state and
RNG states). See docs/checkpoints.md for the full layout.
"""

from __future__ import annotations

import contextlib
import errno
import json
from pathlib import Path
from typing import Any

from .scripts.meta_checks import (  # noqa: F401 - the checks shared with zero_to_fp32.py, re-exported
    FORMAT,
    FORMAT_VERSION,
    LATEST_FILE,
    LAYOUT_FIELDS,
    LAYOUT_KEY,
    META_DIGEST_KEY,
    META_FILE,
    MODEL_FILE,
    RANK_META_KEY,
    READABLE_VERSIONS,
    CheckpointError,
    CheckpointNotFoundError,
    check_meta_digest,
    check_tag,
    layout_digests,
    meta_digest,
    read_json,
    read_text,
    require,
)

SHARD_KINDS = ("master", "exp_avg", "exp_avg_sq")  # fp32, all laid out in the same shard order
RNG_TORCH, RNG_CUDA = "rng.torch_cpu", "rng.cuda"


class TagMismatchError(CheckpointError, AssertionError):
    """Ranks passed different tags under ``checkpoint.tag_validation`` "fail" (DeepSpeed asserts)."""


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def shard_tensor(group: int, kind: str) -> str:
    return f"group{group}.{kind}"


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


def sealed_meta_bytes(meta: dict) -> bytes:
    """meta.json's bytes with its digest added (the last key)."""
    sealed = {k: v for k, v in meta.items() if k != META_DIGEST_KEY}
    sealed[META_DIGEST_KEY] = meta_digest(sealed)
    return json.dumps(sealed, indent=1).encode("utf-8")


@contextlib.contextmanager
def writing(path: Path):
    """Name ``path`` in any OS error while writing it (a full disk's ENOSPC carries no name)."""
    try:
        yield
    except OSError as e:
        if isinstance(e, CheckpointError):
            raise
        what = "no space left on device" if e.errno == errno.ENOSPC else (e.strerror or str(e))
        raise CheckpointError(
            f"{path}: {what} while writing the checkpoint (errno {e.errno}); the previous "
            "checkpoint and 'latest' are untouched"
        ) from e
