"""On-disk names, the metadata schema version, and the checkpoint errors.

A checkpoint is a directory ``<save_dir>/<tag>/`` holding ``meta.json`` (everything that is not a
tensor, plus a digest of every other file), ``model.safetensors`` (the module state dict, written
once by rank 0) and one ``rank_XXXXX.safetensors`` per rank (its master shard, optimizer state and
RNG states). See docs/checkpoints.md for the full layout.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
from pathlib import Path
from typing import Any

FORMAT = "zero_offload.checkpoint"
# 2: meta.json carries META_DIGEST_KEY, the digest of its own content. Version 1 (no digest) is
# still read, with a warning that its metadata is not covered.
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
META_DIGEST_KEY = "meta_sha256"

META_FILE = "meta.json"
MODEL_FILE = "model.safetensors"
LATEST_FILE = "latest"
SHARD_KINDS = ("master", "exp_avg", "exp_avg_sq")  # fp32, all laid out in the same shard order
RNG_TORCH, RNG_CUDA = "rng.torch_cpu", "rng.cuda"
RANK_META_KEY = "zero_offload.rank"  # safetensors __metadata__ key of a rank file's JSON


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or loaded as asked; the message names file and tensor."""


class TagMismatchError(CheckpointError, AssertionError):
    """Ranks passed different tags under ``checkpoint.tag_validation`` "fail" (DeepSpeed asserts)."""


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


def read_text(path: Path) -> str:
    """A text file of the checkpoint, naming the file when it is missing, unreadable or not
    UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path}: file is missing") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(
            f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); the file is damaged"
        ) from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror or e})") from None


def read_json(path: Path) -> Any:
    """Parse a JSON file of the checkpoint, naming the file when it is missing or damaged."""
    text = read_text(path)
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e}); the file is damaged") from None


def meta_digest(meta: dict) -> str:
    """SHA-256 of ``meta`` without its own digest, in a canonical JSON form (sorted keys, no
    spaces): parsing and re-serializing gives the same bytes, so the digest survives reading."""
    body = {k: v for k, v in meta.items() if k != META_DIGEST_KEY}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def sealed_meta_bytes(meta: dict) -> bytes:
    """meta.json's bytes with its digest added (the last key)."""
    sealed = {k: v for k, v in meta.items() if k != META_DIGEST_KEY}
    sealed[META_DIGEST_KEY] = meta_digest(sealed)
    return json.dumps(sealed, indent=1).encode("utf-8")


# The fields of a meta.json group that say where each param lies in the rank files' shards.
LAYOUT_FIELDS = (
    "names",
    "shapes",
    "numels",
    "bucket_params",
    "align",
    "layout_world_size",
    "sharded",
)
LAYOUT_KEY = "layout_sha256"  # in a rank file's RANK_META_KEY JSON: per group, per field


def layout_digests(groups: list) -> list[dict[str, str]]:
    """Per param group, the SHA-256 of each layout field as meta.json records it. Every rank
    file records these, so a meta.json whose layout was changed (and re-sealed) after the rank
    files were written is refused rather than read at the wrong offsets."""
    out = []
    for g in groups:
        out.append(
            {
                k: hashlib.sha256(
                    json.dumps(g.get(k), sort_keys=True, separators=(",", ":")).encode("utf-8")
                ).hexdigest()
                for k in LAYOUT_FIELDS
            }
        )
    return out


def check_meta_digest(meta: dict, where: str) -> None:
    recorded = require(meta, META_DIGEST_KEY, where)
    if recorded != meta_digest(meta):
        raise CheckpointError(
            f"{where}: checksum mismatch (the metadata was changed or damaged after it was "
            "written: counters, hyperparameters or layout cannot be trusted)"
        )


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


def require(meta: dict, key: str, where: str) -> Any:
    if not isinstance(meta, dict) or key not in meta:
        raise CheckpointError(f"{where}: required key {key!r} is missing")
    return meta[key]
