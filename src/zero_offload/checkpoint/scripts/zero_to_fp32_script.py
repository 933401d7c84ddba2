#!/usr/bin/env python
"""zero_to_fp32.py: consolidate a zero_offload checkpoint into fp32 weights.

Every ``engine.save_checkpoint(save_dir)`` puts this script into ``save_dir`` (as DeepSpeed puts
its own there). It needs only torch and safetensors (no zero_offload), and takes DeepSpeed
0.19.8's arguments::

    python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR [-t TAG] [--max_shard_size 5GB]
        [--safe_serialization] [--exclude_frozen_parameters]

``CHECKPOINT_DIR`` is the folder holding ``latest`` and the tag folders (``global_step<N>/``), or
a tag folder itself. ``OUTPUT_DIR`` receives ``pytorch_model.bin`` (``torch.save``; with
``--safe_serialization``: ``model.safetensors``), split as Hugging Face splits weights when they
pass ``--max_shard_size`` (``pytorch_model-00001-of-0000n.bin`` ... and
``pytorch_model.bin.index.json``). Every key of the module's state dict is written: trainable
params as their fp32 master weights (assembled from every rank's shard), frozen params and
buffers as saved (floating ones in fp32); a tied weight under each of its names. Each file read is
checked against the SHA-256 digests ``meta.json`` records, and ``meta.json`` itself as the
library checks it (its own digest, the layout the rank files were written under, a tag that is one
entry of the folder): a checkpoint the library would refuse stops here with one line naming the
file and the problem. The format is described in the project's docs/checkpoints.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import uuid
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

# BEGIN SHARED CHECKS: a save writes the text of the library's meta_checks.py here
from .meta_checks import (
    RANK_META_KEY,
    CheckpointError,
    CheckpointNotFoundError,
    check_digest_schema,
    check_group,
    check_meta,
    check_rank_layout,
    check_tag,
    latest_tag,
    read_json,
)

# END SHARED CHECKS

META, MODEL, LATEST = "meta.json", "model.safetensors", "latest"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def _tag_dir(checkpoint_dir, tag: str | None) -> Path:
    """The tag folder: ``latest``'s tag when None (or ``checkpoint_dir`` itself when it holds
    meta.json); a tag left aside by an interrupted replacement (``.<tag>.replaced``) is used."""
    root = Path(checkpoint_dir)
    if tag is None and (root / META).is_file():
        return root
    if tag is None:
        if not (root / LATEST).is_file():
            raise CheckpointNotFoundError(f"{root / LATEST}: file is missing; pass -t TAG")
        tag = latest_tag(root / LATEST)  # one entry of this folder, as the library requires
    check_tag(str(tag))
    for path in (root / tag, root / f".{tag}.replaced"):
        if (path / META).is_file():
            return path
    raise CheckpointNotFoundError(f"{root / tag}: no checkpoint with tag {tag!r} ({META} missing)")


def _verify(folder: Path, meta: dict, name: str) -> None:
    """``name`` has the size and SHA-256 (of its blocks' digests) that meta.json records."""
    files = meta["files"]
    if not isinstance(files, dict) or name not in files:
        raise CheckpointError(f"{folder / META}: no digest recorded for {name}")
    entry = files[name]
    check_digest_schema(folder / name, entry)
    if not (folder / name).is_file():
        raise CheckpointNotFoundError(f"{folder / name}: file is missing")
    raw_digests = []
    with open(folder / name, "rb") as f:
        size = 0
        while block := f.read(int(entry["block_size"])):
            size += len(block)
            raw_digests.append(hashlib.sha256(block).digest())
    if (
        size != int(entry["size"])
        or hashlib.sha256(b"".join(raw_digests)).hexdigest() != entry["sha256"]
    ):
        raise CheckpointError(f"{folder / name}: checksum mismatch (the file is damaged)")


def _layout(group: dict) -> tuple[list[int], list[tuple[int, int, int, list[int]]]]:
    """Param offsets and buckets ``(flat start, padded numel, shard start, params)`` of a saved
    group: each bucket padded to a multiple of world * align, rank r owning its r-th slice."""
    numels, world = [int(n) for n in group["numels"]], int(group["layout_world_size"])
    unit = world * int(group["align"])
    offsets, buckets, start, shard_start = [0] * len(numels), [], 0, 0
    for members in group["bucket_params"]:
        pos = start
        for i in members:
            offsets[i] = pos
            pos += numels[i]
        padded = max(-(-(pos - start) // unit) * unit, unit)
        buckets.append((start, padded, shard_start, list(members)))
        start += padded
        shard_start += padded // world
    return offsets, buckets


def _pieces(group: dict, rank_files: list[str]) -> dict[str, list[tuple[str, int, int, int]]]:
    """Per param name: ``(rank file, shard position, element lo, numel)`` reads of its master."""
    offsets, buckets = _layout(group)
    numels, world = [int(n) for n in group["numels"]], int(group["layout_world_size"])
    sources = range(world) if group["sharded"] else [None]
    out: dict[str, list] = {name: [] for name in group["names"]}
    for r in sources:
        for start, padded, shard_start, members in buckets:
            if r is None:  # unsharded (stage 0): rank 0 holds the whole flat buffer
                seg_lo, seg_n, seg_pos = start, padded, start
            else:
                seg_n = padded // world
                seg_lo, seg_pos = start + r * seg_n, shard_start
            for i in members:
                lo, hi = max(offsets[i], seg_lo), min(offsets[i] + numels[i], seg_lo + seg_n)
                if lo < hi:
                    read = (rank_files[r or 0], seg_pos + lo - seg_lo, lo - offsets[i], hi - lo)
                    out[group["names"][i]].append(read)
    return out


class _Reader:
    """Lazily produced fp32 tensors of a checkpoint's state dict, by key. meta.json is checked
    as the library checks it before anything in it is used; each file before it is read."""

    def __init__(self, folder: Path, exclude_frozen: bool) -> None:
        self.folder = folder
        where = folder / META
        self.meta = read_json(where)
        if check_meta(self.meta, str(where)) < 2:
            print(f"warning: {where}: format_version 1 has no checksum of its own metadata")
        model = self.meta["model"]
        self.aliases = dict(model.get("aliases", {}))
        frozen = set(model.get("frozen", []))
        self.keys = [k for k in model.get("keys", []) if not (exclude_frozen and k in frozen)]
        self.trainable: dict[str, tuple[int, list, list]] = {}
        ranks = self.meta["ranks"]
        if not isinstance(ranks, dict) or "files" not in ranks:
            raise CheckpointError(f"{where} ranks: required key 'files' is missing")
        self.shard_numel: list[int] = []
        for gi, group in enumerate(self.meta["groups"]):
            fields = check_group(group, f"{where} groups[{gi}]", ranks["files"])
            _, buckets = _layout(group)
            total = sum(b[1] for b in buckets)
            self.shard_numel.append(total // fields.world if fields.sharded else total)
            shapes = dict(zip(fields.names, fields.shapes))
            for name, reads in _pieces(group, ranks["files"]).items():
                self.trainable[name] = (gi, reads, shapes[name])
        self.verified: set[str] = set()
        self.shards_checked: set[tuple[str, int]] = set()

    def _open(self, name: str):
        if name not in self.verified:
            _verify(self.folder, self.meta, name)
            if name != MODEL:  # a rank file: written under the layout meta.json describes?
                with safe_open(str(self.folder / name), framework="pt") as f:
                    rank_meta = (f.metadata() or {}).get(RANK_META_KEY)
                groups = self.meta["groups"]
                check_rank_layout(rank_meta, groups, self.folder / META, self.folder / name)
            self.verified.add(name)
        return safe_open(str(self.folder / name), framework="pt")

    def _model_tensor(self, f, target: str):
        if target not in f.keys():
            raise CheckpointError(f"{self.folder / MODEL}: tensor {target!r} is missing")
        return f.get_slice(target)

    def _master(self, f, file: str, gi: int):
        """Group ``gi``'s master shard in rank file ``file``, of the size meta.json implies."""
        tensor, want = f"group{gi}.master", self.shard_numel[gi]
        if (file, gi) not in self.shards_checked:
            got = f.get_slice(tensor) if tensor in f.keys() else None
            if got is None:
                raise CheckpointError(f"{self.folder / file}: tensor {tensor!r} is missing")
            if got.get_dtype() != "F32" or list(got.get_shape()) != [want]:
                raise CheckpointError(
                    f"{self.folder / file}: tensor {tensor!r} is {got.get_dtype()} "
                    f"{list(got.get_shape())}, but {self.folder / META} groups[{gi}] (numels, "
                    f"bucket_params, align, layout_world_size, sharded) describes F32 [{want}]: "
                    "the layout in meta.json is not the one this file was written under"
                )
            self.shards_checked.add((file, gi))
        return f.get_slice(tensor)

    def spec(self, key: str) -> tuple[torch.dtype, list[int]]:
        target = self.aliases.get(key, key)
        if target in self.trainable:
            return torch.float32, list(self.trainable[target][2])
        with self._open(MODEL) as f:
            t = self._model_tensor(f, target)
            dtype = getattr(torch, _ST_DTYPES.get(t.get_dtype(), "float32"))
            return (torch.float32 if dtype.is_floating_point else dtype), t.get_shape()

    def tensor(self, key: str) -> torch.Tensor:
        target = self.aliases.get(key, key)
        if target not in self.trainable:
            with self._open(MODEL) as f:
                self._model_tensor(f, target)  # named when missing
                t = f.get_tensor(target)
            return t.float() if t.is_floating_point() else t
        gi, reads, shape = self.trainable[target]
        out = torch.empty(_numel(shape), dtype=torch.float32)
        for file, pos, lo, n in reads:
            with self._open(file) as f:
                out[lo : lo + n] = self._master(f, file, gi)[pos : pos + n]
        return out.view(shape)


_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_ST_DTYPES.update({"I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8"})
_ST_DTYPES.update({"BOOL": "bool"})


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def get_fp32_state_dict(checkpoint_dir, tag=None, exclude_frozen_parameters=False) -> dict:
    """The module's state dict with fp32 master weights (tied keys share one tensor)."""
    reader = _Reader(_tag_dir(checkpoint_dir, tag), exclude_frozen_parameters)
    out: dict[str, torch.Tensor] = {}
    for key in reader.keys:
        target = reader.aliases.get(key, key)
        out[key] = out[target] if target in out else reader.tensor(key)
    return out


def parse_size(size) -> int | None:
    """Hugging Face's shard-size syntax: ``"5GB"`` = 5 * 10**9 bytes, ``"2GiB"``, or bytes."""
    if size is None or isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size).upper())
    if not m:
        raise ValueError(f"max_shard_size: {size!r} is not a size (5GB, 500MB, 2GiB, bytes)")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def _split(specs: list[tuple[str, int]], limit: int | None) -> list[list[str]]:
    """huggingface_hub's split: keys in order, a new shard when the next would pass ``limit``."""
    shards: list[list[str]] = [[]]
    size = 0
    for key, nbytes in specs:
        if limit is not None and shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    return shards


def _shard_names(weights: str, count: int) -> list[str]:
    if count == 1:
        return [weights]
    stem, ext = os.path.splitext(weights)
    return [f"{stem}-{k:05d}-of-{count:05d}{ext}" for k in range(1, count + 1)]


def _aside(path: Path) -> Path:
    """A fresh name beside ``path`` for this one write: writers converting into the same folder
    at once (every rank of a job calling the function) each rename their own whole file."""
    return path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")


def _write(path: Path, tensors: dict, safe: bool) -> None:
    """One file, written aside and renamed into place (never a half-written file)."""
    tmp = _aside(path)
    if safe:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    else:
        torch.save(tensors, str(tmp))
    os.replace(tmp, path)


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir,
    output_dir,
    max_shard_size="5GB",
    safe_serialization=False,
    tag=None,
    exclude_frozen_parameters=False,
) -> list[Path]:
    """DeepSpeed 0.19.8's function: the fp32 state dict into ``output_dir`` as
    ``pytorch_model.bin`` (``model.safetensors`` with ``safe_serialization``), sharded past
    ``max_shard_size`` (None: one file) with Hugging Face's index. One shard's tensors are held
    at a time. Returns the files written (the index last)."""
    reader = _Reader(_tag_dir(checkpoint_dir, tag), exclude_frozen_parameters)
    specs = []
    for key in reader.keys:
        dtype, shape = reader.spec(key)
        specs.append((key, _numel(shape) * torch.empty((), dtype=dtype).element_size()))
    shards = _split(specs, parse_size(max_shard_size))
    weights = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    names = _shard_names(weights, len(shards))
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, keys in zip(names, shards):
        tensors: dict[str, torch.Tensor] = {}
        by_target: dict[str, torch.Tensor] = {}
        for key in keys:
            target = reader.aliases.get(key, key)
            if target not in by_target:
                by_target[target] = reader.tensor(key)
            elif safe_serialization:  # safetensors stores no shared tensors: a copy per name
                tensors[key] = by_target[target].clone()
                continue
            tensors[key] = by_target[target]
        _write(out / name, tensors, safe_serialization)
        written.append(out / name)
    if len(names) > 1:
        index = {
            "metadata": {"total_size": sum(n for _, n in specs)},
            "weight_map": {key: name for name, keys in zip(names, shards) for key in keys},
        }
        path = out / f"{weights}.index.json"
        tmp = _aside(path)
        tmp.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, path)
        written.append(path)
    return written


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "checkpoint_dir", help="the checkpoint folder (holding 'latest'), e.g. path/checkpoint-12"
    )
    parser.add_argument(
        "output_dir", help="where the fp32 weights go, e.g. path/checkpoint-12-fp32"
    )
    parser.add_argument(
        "--max_shard_size",
        default="5GB",
        help="split the weights into shards of at most this size (5GB, 500MB, 2GiB, bytes)",
    )
    parser.add_argument(
        "--safe_serialization",
        action="store_true",
        help="write safetensors (model.safetensors) instead of torch.save (pytorch_model.bin)",
    )
    parser.add_argument("-t", "--tag", default=None, help="the checkpoint tag (default: latest's)")
    parser.add_argument("--exclude_frozen_parameters", action="store_true")
    parser.add_argument("-d", "--debug", action="store_true", help="accepted, as DeepSpeed's")
    args = parser.parse_args(argv)
    try:
        files = convert_zero_checkpoint_to_fp32_state_dict(
            args.checkpoint_dir,
            args.output_dir,
            max_shard_size=args.max_shard_size,
            safe_serialization=args.safe_serialization,
            tag=args.tag,
            exclude_frozen_parameters=args.exclude_frozen_parameters,
        )
    except CheckpointError as e:  # one line naming the file and the problem, no traceback
        sys.exit(f"zero_to_fp32.py: error: {e}")
    for path in files:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
