"""The checks a reader of a checkpoint makes before trusting ``meta.json``, in one place for the
library's reader and for the standalone ``zero_to_fp32.py`` every save writes.

This file uses the standard library only and imports nothing from the package: the script a save
writes is ``zero_to_fp32_script.py`` with this file's text put in place of its import of it
(``script_source.py``), so the script refuses exactly what the library refuses (a ``meta.json``
changed after it was written, a layout that is not the one the rank files were written under, a
``latest`` or tag that is not one entry of the folder), with the same messages naming the file.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
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
RANK_META_KEY = "zero_offload.rank"  # safetensors __metadata__ key of a rank file's JSON
META_REQUIRED = ("world_size", "files", "model", "groups", "counters", "ranks")

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


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or loaded as asked; the message names file and tensor."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A tag, a ``latest`` target or a file of the checkpoint is missing."""


def require(meta: dict, key: str, where: str) -> Any:
    if not isinstance(meta, dict) or key not in meta:
        raise CheckpointError(f"{where}: required key {key!r} is missing")
    return meta[key]


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


def latest_tag(path: Path) -> str:
    """The tag the ``latest`` file at ``path`` names: one entry of its own folder."""
    tag = read_text(path).strip()
    if not tag:
        raise CheckpointError(f"{path}: file is empty; expected the name of a checkpoint tag")
    try:  # ``latest`` may only name an entry of this folder (no "..", "/", absolute paths)
        check_tag(tag)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}; the file is damaged or was edited") from None
    return tag


def meta_digest(meta: dict) -> str:
    """SHA-256 of ``meta`` without its own digest, in a canonical JSON form (sorted keys, no
    spaces): parsing and re-serializing gives the same bytes, so the digest survives reading."""
    body = {k: v for k, v in meta.items() if k != META_DIGEST_KEY}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def check_meta_digest(meta: dict, where: str) -> None:
    recorded = require(meta, META_DIGEST_KEY, where)
    if recorded != meta_digest(meta):
        raise CheckpointError(
            f"{where}: checksum mismatch (the metadata was changed or damaged after it was "
            "written: counters, hyperparameters or layout cannot be trusted)"
        )


def check_meta(meta: Any, where: str) -> int:
    """The checks of a parsed ``meta.json`` before anything in it is used: the format, a readable
    version, its own digest (version 2) and the required keys. Returns the version (1: the
    caller warns that the metadata is not covered by a digest)."""
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(
            f"{where}: not a zero_offload checkpoint (format {FORMAT!r} expected)"
        )
    version = require(meta, "format_version", where)
    if version not in READABLE_VERSIONS:
        raise CheckpointError(
            f"{where}: format_version {version} is not supported (this version reads "
            f"{', '.join(map(str, READABLE_VERSIONS))})"
        )
    if version >= 2:
        check_meta_digest(meta, where)
    for key in META_REQUIRED:
        require(meta, key, where)
    return version


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


def check_digest_schema(path: Path, digest: Any) -> None:
    """A file's entry in ``meta.json``'s ``files`` has a size, a block size and one digest per
    block."""
    try:
        size, bs, blocks = int(digest["size"]), int(digest["block_size"]), digest["block_sha256"]
        ok = bs > 0 and isinstance(blocks, list) and len(blocks) == max(1, -(-size // bs))
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise CheckpointError(f"meta.json: the digest recorded for {path.name} is malformed")


@dataclass(frozen=True)
class GroupFields:
    """One ``groups[g]`` entry of ``meta.json``, checked for structure."""

    names: list[str]
    shapes: list[tuple[int, ...]]
    numels: list[int]
    buckets: list[list[int]]
    world: int
    align: int
    sharded: bool
    files: list[str]  # one per source shard: rank files when sharded, rank 0's file otherwise


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def check_group(g: Any, where: str, rank_files: Any) -> GroupFields:
    """``groups[g]`` (``where`` names it) holds consistent names, shapes and numels, a layout
    whose buckets split the params in order, and a rank file per shard."""
    try:
        names = [str(n) for n in require(g, "names", where)]
        shapes = [tuple(int(d) for d in s) for s in require(g, "shapes", where)]
        numels = [int(n) for n in require(g, "numels", where)]
        buckets = [[int(i) for i in b] for b in require(g, "bucket_params", where)]
        world = int(require(g, "layout_world_size", where))
        align = int(require(g, "align", where))
        sharded = bool(require(g, "sharded", where))
    except (TypeError, ValueError, IndexError) as e:
        raise CheckpointError(f"{where}: malformed ({e})") from None
    if (
        len(names) != len(shapes)
        or len(names) != len(numels)
        or any(_numel(s) != n for s, n in zip(shapes, numels))
        or any(d < 0 for s in shapes for d in s)
    ):
        raise CheckpointError(f"{where}: names, shapes and numels disagree")
    if world < 1 or align < 1:
        raise CheckpointError(
            f"{where}: layout_world_size and align must be >= 1, got {world} and {align}"
        )
    if any(not b for b in buckets) or [i for b in buckets for i in b] != list(range(len(numels))):
        shown = str(buckets) if len(str(buckets)) <= 80 else str(buckets)[:77] + "..."
        raise CheckpointError(
            f"{where}.bucket_params: {shown} must split params 0..{len(numels) - 1} into "
            "non-empty buckets of consecutive params, in order (as every layout is "
            "built); the metadata was edited or damaged"
        )
    if not isinstance(rank_files, list) or not all(isinstance(f, str) for f in rank_files):
        raise CheckpointError(f"{where}: ranks.files must be a list of file names")
    files = list(rank_files[:world]) if sharded else list(rank_files[:1])
    if len(files) != (world if sharded else 1):
        raise CheckpointError(f"{where}: {world} shards but {len(rank_files)} rank files listed")
    return GroupFields(names, shapes, numels, buckets, world, align, sharded, files)


def check_rank_layout(rank_meta: str | None, groups: list, meta_path: Path, path: Path) -> None:
    """The rank file at ``path`` (its ``RANK_META_KEY`` metadata: ``rank_meta``) was written
    under the layout ``meta.json`` describes: it records a digest of each group's layout fields
    (rank files of older versions do not, and are not checked)."""
    try:
        info = json.loads(rank_meta or "{}")
    except ValueError as e:
        raise CheckpointError(f"{path}: rank metadata is not JSON ({e})") from None
    recorded = info.get(LAYOUT_KEY) if isinstance(info, dict) else None
    if recorded is None:
        return
    described = layout_digests(groups)
    if not isinstance(recorded, list) or len(recorded) != len(described):
        count = len(recorded) if isinstance(recorded, list) else "no"
        raise CheckpointError(
            f"{meta_path} groups: {len(described)} param groups, but {path} was written with "
            f"{count} groups"
        )
    for gi, (got, want) in enumerate(zip(recorded, described)):
        for key in LAYOUT_FIELDS:
            if not isinstance(got, dict) or got.get(key) != want[key]:
                raise CheckpointError(
                    f"{meta_path} groups[{gi}].{key}: not the one {path} was written under (the "
                    "metadata was edited and re-sealed, or belongs to other rank files); "
                    "refusing to read the shards at the wrong offsets"
                )
