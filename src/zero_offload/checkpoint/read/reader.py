"""A checkpoint directory opened for reading: ``meta.json`` parsed and schema-checked, safetensors
headers parsed on demand, checksums verified for the bytes a caller will read, slices read with
``safetensors.safe_open(...).get_slice`` (no file is ever read whole unless asked, nothing is
unpickled)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from ...core.layout import FlatLayout, layout_from_buckets
from .. import atomic
from ..format import (
    META_FILE,
    RANK_META_KEY,
    SHARD_KINDS,
    CheckpointError,
    CheckpointNotFoundError,
    check_tag,
    read_json,
    require,
    shard_tensor,
)
from ..scripts.meta_checks import check_digest_schema, check_group, check_meta, check_rank_layout
from ..tensor_file import Header, read_header, verify
from .reslice import Piece, SourceIndex, shard_pieces, source_segments

log = logging.getLogger("zero_offload")


@dataclass
class GroupMeta:
    """One saved param group: its names and shapes (flat order), the layout it was saved under,
    and which rank files hold its shards."""

    index: int
    names: list[str]
    shapes: list[tuple[int, ...]]
    layout: FlatLayout
    sharded: bool
    step_count: int
    hyper: dict
    files: list[str]  # one per source shard: rank files when sharded, rank 0's file otherwise
    client: dict | None = None  # a client optimizer's state spec (client_update.py), or None

    @property
    def kinds(self) -> list[str]:
        """The shard kinds of this group's rank-file tensors: the master and the Adam moments,
        or under a client optimizer the master and the client's elementwise state."""
        if self.client is None:
            return list(SHARD_KINDS)
        return ["master", *(f"client.{k}" for k in self.client["shard"])]

    @property
    def shard_numel(self) -> int:
        return self.layout.shard_numel if self.sharded else self.layout.total

    @cached_property
    def index_by_name(self) -> SourceIndex:
        """The old shards' pieces by param name (what re-slicing queries)."""
        segs = source_segments(self.layout, self.sharded)
        return SourceIndex([shard_pieces(self.layout, s, self.names) for s in segs])


class CheckpointReader:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.meta = read_json(self.path / META_FILE)
        where = str(self.path / META_FILE)
        if check_meta(self.meta, where) < 2:
            log.warning("%s: format_version 1 has no checksum of its own metadata", where)
        self._headers: dict[str, Header] = {}
        self._layout_checked: set[str] = set()
        self._handles: dict[str, object] = {}
        self._slices: dict[tuple[str, str], object] = {}

    @classmethod
    def open(cls, root, tag: str | None) -> CheckpointReader | None:
        """The checkpoint ``tag`` of ``root`` (``latest``'s when None; None when there is no
        ``latest`` or no ``root``). ``root`` may also be a tag directory itself (it holds
        meta.json)."""
        root = Path(root)
        if tag is None and (root / META_FILE).is_file():
            return cls(root)
        if not root.is_dir():
            if tag is None:
                return None  # a first run: nothing saved yet, as with a missing ``latest``
            raise CheckpointNotFoundError(f"checkpoint directory {root} does not exist")
        from_latest = tag is None
        if tag is None:
            tag = atomic.read_latest(root)
            if tag is None:
                return None
        check_tag(str(tag))
        try:
            path = atomic.resolve(root, str(tag))
        except CheckpointNotFoundError as e:
            if not from_latest:
                raise
            raise CheckpointNotFoundError(
                f"{root / atomic.LATEST_FILE} names tag {tag!r}, which does not exist ({e}); "
                "the file is damaged or the checkpoint was removed"
            ) from None
        if path.name != str(tag):
            log.warning(
                "checkpoint %s: using %s, left by an interrupted replacement of that tag", tag, path
            )
        return cls(path)

    # ---- files ---------------------------------------------------------------------------------
    def digest(self, name: str) -> dict:
        files = self.meta["files"]
        if not isinstance(files, dict) or name not in files:
            raise CheckpointError(f"{self.path / META_FILE}: no digest recorded for {name}")
        return files[name]

    def header(self, name: str) -> Header:
        """Parsed header of ``name``; the file must exist with the recorded size."""
        if name not in self._headers:
            path = self.path / name
            digest = self.digest(name)
            check_digest_schema(path, digest)
            if not path.is_file():
                raise CheckpointNotFoundError(f"{path}: file is missing")
            size = path.stat().st_size
            if size != digest.get("size"):
                raise CheckpointError(
                    f"{path}: {size} bytes, the checkpoint recorded {digest.get('size')} (truncated or changed)"
                )
            self._headers[name] = read_header(path)
        return self._headers[name]

    def require_tensor(
        self, name: str, tensor: str, dtype: str | None, shape: tuple[int, ...] | None
    ):
        info = self.header(name).tensors.get(tensor)
        if info is None:
            raise CheckpointError(f"{self.path / name}: tensor {tensor!r} is missing")
        if (dtype is not None and info.dtype != dtype) or (
            shape is not None and info.shape != tuple(shape)
        ):
            raise CheckpointError(
                f"{self.path / name}: tensor {tensor!r} is {info.dtype} {list(info.shape)}, "
                f"expected {dtype or info.dtype} {list(shape) if shape is not None else list(info.shape)}"
            )
        return info

    def require_shard(self, group: GroupMeta, name: str, kind: str) -> None:
        """``name`` holds ``group``'s ``kind`` shard with the size meta.json's layout implies."""
        tensor = shard_tensor(group.index, kind)
        info = self.header(name).tensors.get(tensor)
        if info is None:
            raise CheckpointError(f"{self.path / name}: tensor {tensor!r} is missing")
        if info.dtype != "F32" or info.shape != (group.shard_numel,):
            raise CheckpointError(
                f"{self.path / name}: tensor {tensor!r} is {info.dtype} {list(info.shape)}, but "
                f"{self.path / META_FILE} groups[{group.index}] (numels, bucket_params, align, "
                f"layout_world_size, sharded) describes F32 [{group.shard_numel}]: the layout in "
                "meta.json is not the one this file was written under"
            )

    def check_layout(self, name: str) -> None:
        """Rank file ``name`` was written under the layout meta.json describes: it records a
        digest of each group's layout fields (rank files of older versions do not, and are not
        checked). Call after ``verify`` has checked ``name``'s header."""
        if name in self._layout_checked:
            return
        rank_meta = self.header(name).metadata.get(RANK_META_KEY)
        check_rank_layout(rank_meta, self.meta["groups"], self.path / META_FILE, self.path / name)
        self._layout_checked.add(name)

    def verify(self, name: str, ranges: Iterable[tuple[int, int]] | None) -> None:
        """Checksum the blocks holding the header and ``ranges`` (the whole file when None)."""
        header = self.header(name)
        if ranges is not None:
            ranges = [(0, header.data_start), *ranges]
        verify(self.path / name, self.digest(name), ranges, header)

    def tensor_range(
        self, name: str, tensor: str, lo: int | None = None, hi: int | None = None
    ) -> tuple[int, int]:
        header = self.header(name)
        info = header.tensors[tensor]
        if lo is None:
            return header.data_start + info.begin, header.data_start + info.end
        itemsize = (info.end - info.begin) // max(1, _numel(info.shape))
        return header.byte_range(tensor, lo, hi, itemsize)

    # ---- data ----------------------------------------------------------------------------------
    def _handle(self, name: str):
        if name not in self._handles:
            from safetensors import safe_open

            self._handles[name] = safe_open(str(self.path / name), framework="pt", device="cpu")
        return self._handles[name]

    def read_tensor(self, name: str, tensor: str) -> torch.Tensor:
        return self._handle(name).get_tensor(tensor)

    def read_slice(self, name: str, tensor: str, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of the 1-D tensor ``tensor``; only those bytes are read."""
        key = (name, tensor)
        if key not in self._slices:
            self._slices[key] = self._handle(name).get_slice(tensor)
        return self._slices[key][lo:hi]

    def close(self) -> None:
        self._slices.clear()
        self._handles.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- schema --------------------------------------------------------------------------------
    @cached_property
    def groups(self) -> list[GroupMeta]:
        where = f"{self.path / META_FILE}"
        rank_files = require(self.meta["ranks"], "files", f"{where} ranks")
        out = []
        for gi, g in enumerate(self.meta["groups"]):
            w = f"{where} groups[{gi}]"
            f = check_group(g, w, rank_files)
            layout = layout_from_buckets(f.numels, f.buckets, f.world, f.align)
            names, shapes, sharded, files = f.names, f.shapes, f.sharded, f.files
            out.append(
                GroupMeta(
                    gi,
                    names,
                    shapes,
                    layout,
                    sharded,
                    int(g.get("step_count", 0)),
                    dict(g.get("hyper", {})),
                    files,
                    _client_spec(g.get("client"), w),
                )
            )
        return out

    def param_pieces(
        self, group: GroupMeta, name: str, numel: int
    ) -> list[tuple[str, int, int, int]]:
        """Where param ``name``'s elements lie: (file, old shard lo, dst lo, numel) reads."""
        reads = group.index_by_name.reads([Piece(name, 0, numel, 0)])
        return [(group.files[r.source], r.src, r.dst, r.numel) for r in reads]


def _client_spec(spec, where: str) -> dict | None:
    if spec is None:
        return None
    ok = (
        isinstance(spec, dict)
        and isinstance(spec.get("class"), str)
        and isinstance(spec.get("shard"), list)
        and all(isinstance(k, str) for k in spec["shard"])
        and isinstance(spec.get("scalars"), dict)
        and all(isinstance(v, dict) and "value" in v for v in spec["scalars"].values())
    )
    if not ok:
        raise CheckpointError(
            f"{where}.client: malformed (expected class, shard keys and scalars of a client "
            "optimizer's state)"
        )
    return spec


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
