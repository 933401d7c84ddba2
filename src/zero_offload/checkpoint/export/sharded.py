"""Hugging Face's sharded safetensors layout, written as a stream.

A model of N tensors becomes ``model-00001-of-0000k.safetensors`` ... plus
``model.safetensors.index.json`` (``{"metadata": {"total_size": bytes, ...}, "weight_map":
{name: file}}``), or one ``model.safetensors`` when everything fits in one shard, exactly as
``save_pretrained`` lays it out (``huggingface_hub.split_torch_state_dict_into_shards``: tensors
in order, a new shard when the next tensor would pass ``max_shard_size``, a tensor larger than
that alone in its own shard).

Streaming: the plan (every tensor's name, dtype and shape, so every shard's header and the file
count) is made before any data exists; then tensors arrive one at a time (``ShardWriter.add``) and
go straight to disk, one 16 MiB chunk at a time (a device tensor is staged through the host a
chunk at a time). Nothing holds more than the tensor being written.

Where the tensors come from at ZeRO stage 3: ``gathered`` walks a list of ``Item``s and, before
each, gathers the stage-3 slots its params live in (a collective: every rank walks the same list)
and afterwards releases the ones the next item does not need, so at most one item's slots (one
module's params; a LoRA layer's base weight and adapters) are gathered at a time. Rank 0 writes,
the other ranks only take part in the gathers.

Atomicity (``publish.py``): the new export is built whole in a sibling folder and
swapped in for ``<out>`` in one rename, so a kill at any instant leaves the previous export whole
or the new one; a folder that cannot be swapped safely (it holds folders or links, is a mount
point or the working directory) gets the files moved in, the index last.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...core import partitioned
from .. import atomic
from ..format import CheckpointError
from ..tensor_file import CHUNK_BYTES, byte_chunks, dtype_name
from . import folder_swap
from . import publish as export_publish

WEIGHTS_NAME = "model.safetensors"
# transformers 5's ``save_pretrained(max_shard_size="50GB")`` (huggingface_hub's own helper
# defaults to 5GB; transformers passes 50GB).
DEFAULT_MAX_SHARD_SIZE = "50GB"

_UNITS = {
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(value: int | str) -> int:
    """Bytes from Hugging Face's ``max_shard_size`` syntax: an int, or digits and a unit
    (``"5GB"`` = 5 * 10**9, ``"500MB"``, ``"2GiB"`` = 2 * 2**30; KB, MB, GB, TB and their
    binary KiB..TiB). Positive only."""
    if isinstance(value, bool):
        raise ValueError(f"max_shard_size must be a size such as '5GB' or an int, got {value!r}")
    if isinstance(value, int):
        size = value
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(value))
        unit = m.group(2).upper() if m else ""
        if m is None or (unit and unit not in _UNITS):
            raise ValueError(
                f"max_shard_size {value!r}: expected bytes as an int, or digits and a unit "
                "(KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '5GB' or '500MB'"
            )
        size = int(float(m.group(1)) * _UNITS.get(unit, 1))
    if size <= 0:
        raise ValueError(f"max_shard_size must be positive, got {value!r}")
    return size


@dataclass(frozen=True)
class Spec:
    """One tensor of the plan."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def plan_shards(specs: Sequence[Spec], max_shard_size: int) -> list[list[Spec]]:
    """huggingface_hub's split, in order: a tensor that would push the current shard past
    ``max_shard_size`` starts a new one; a tensor larger than the limit is a shard of its own."""
    shards: list[list[Spec]] = []
    current: list[Spec] = []
    size = 0
    for s in specs:
        n = s.nbytes
        if n > max_shard_size:
            shards.append([s])
            continue
        if size + n > max_shard_size and current:
            shards.append(current)
            current, size = [], 0
        current.append(s)
        size += n
    if current or not shards:
        shards.append(current)
    return shards


def shard_file_names(weights_name: str, count: int) -> list[str]:
    """``model.safetensors`` for one shard, else ``model-0000i-of-0000n.safetensors``."""
    if count == 1:
        return [weights_name]
    stem, dot, ext = weights_name.rpartition(".")
    if not dot:
        stem, ext = weights_name, ""
    suffix = f".{ext}" if ext else ""
    return [f"{stem}-{i + 1:05d}-of-{count:05d}{suffix}" for i in range(count)]


def index_name(weights_name: str) -> str:
    return f"{weights_name}.index.json"


def _shard_pattern(weights_name: str) -> re.Pattern:
    stem, dot, ext = weights_name.rpartition(".")
    if not dot:
        stem, ext = weights_name, ""
    suffix = re.escape(f".{ext}") if ext else ""
    return re.compile(rf"{re.escape(stem)}-\d{{5}}-of-\d{{5}}{suffix}")


def _header(specs: Sequence[Spec], metadata: dict[str, str] | None) -> bytes:
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    pos = 0
    for s in specs:
        if s.name in header:
            raise CheckpointError(f"tensor name {s.name!r} appears twice in one export")
        n = s.nbytes
        header[s.name] = {
            "dtype": dtype_name(s.dtype, s.name),
            "shape": [int(d) for d in s.shape],
            "data_offsets": [pos, pos + n],
        }
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


@dataclass
class ExportResult:
    out_dir: Path
    files: list[Path]  # the weight files, in order
    index: Path | None  # None for a single file
    total_size: int
    tensors: int
    extra: list[Path] = field(default_factory=list)  # config.json and the like


class ShardWriter:
    """Rank 0's writer: ``add`` the tensors of ``specs`` in that order, then ``publish``.

    ``out_dir`` is created if missing; files are staged in the sibling folder ``stage_dir``
    (write config files there too) until ``publish`` swaps it in. ``abort`` (or an exception
    from ``add``/``publish``) removes the staging folder and leaves ``out_dir`` as it was."""

    def __init__(
        self,
        out_dir,
        specs: Sequence[Spec],
        max_shard_size: int | str | None = DEFAULT_MAX_SHARD_SIZE,
        weights_name: str = WEIGHTS_NAME,
        metadata: dict[str, str] | None = None,
        index_metadata: dict | None = None,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        self.out_dir = Path(out_dir)
        self.weights_name = weights_name
        self.chunk_bytes = chunk_bytes
        limit = None if max_shard_size is None else parse_size(max_shard_size)
        self.shards = [list(specs)] if limit is None else plan_shards(specs, limit)
        self.names = shard_file_names(weights_name, len(self.shards))
        self.metadata = {"format": "pt", **(metadata or {})}
        self.index_metadata = dict(index_metadata or {})
        self.total_size = sum(s.nbytes for s in specs)
        self.count = len(specs)
        seen: set[str] = set()
        for s in specs:
            if s.name in seen:
                raise CheckpointError(f"export: tensor name {s.name!r} appears twice")
            seen.add(s.name)
        # Stream order is spec order; a tensor larger than the limit is its own shard, numbered
        # before the shard still filling, so up to two files are open at once.
        shard_of = {id(s): k for k, shard in enumerate(self.shards) for s in shard}
        self._order = [(shard_of[id(s)], s) for s in specs]
        self._pos = 0
        self._files: dict[int, object] = {}
        self._left = [len(shard) for shard in self.shards]
        self._check_targets()
        with _naming(self.out_dir, "create the export folder"):
            folder_swap.recover(self.out_dir)  # a swap a kill interrupted (non-Linux only)
            self.swap = export_publish.swappable(self.out_dir)
            self.out_dir.mkdir(parents=True, exist_ok=True)
        self.stage_dir = export_publish.staging_folder(self.out_dir, self.swap)
        with _naming(self.stage_dir, "prepare the staging folder"):
            for stale in (self.stage_dir, export_publish.staging_folder(self.out_dir, True)):
                if stale.exists():
                    shutil.rmtree(stale)  # left by a crashed export
            self.stage_dir.mkdir()

    @property
    def sharded(self) -> bool:
        return len(self.shards) > 1

    def _check_targets(self) -> None:
        for name in [*self.names, index_name(self.weights_name)]:
            p = self.out_dir / name
            if p.is_dir():
                raise CheckpointError(
                    f"{p}: is a folder; the export writes a file there (remove it or choose "
                    "another output folder)"
                )

    # ---- writing -------------------------------------------------------------------------------
    def expected(self) -> Spec | None:
        """The spec the next ``add`` must match (None when all were written)."""
        return self._order[self._pos][1] if self._pos < len(self._order) else None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self._pos >= len(self._order):
            raise CheckpointError(f"export: tensor {name!r} is beyond the planned {self.count}")
        k, spec = self._order[self._pos]
        if name != spec.name or tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise CheckpointError(
                f"export: got tensor {name!r} {tensor.dtype} {tuple(tensor.shape)} where the plan "
                f"has {spec.name!r} {spec.dtype} {spec.shape}"
            )
        if k not in self._files:
            self._open(k)
        path = self.stage_dir / self.names[k]
        with _naming(path, "write"):
            for mv in byte_chunks(tensor, self.chunk_bytes):
                self._files[k].write(mv)
        self._pos += 1
        self._left[k] -= 1
        if self._left[k] == 0:
            self._close(k)

    def _open(self, k: int) -> None:
        path = self.stage_dir / self.names[k]
        with _naming(path, "write"):
            self._files[k] = open(path, "wb")  # noqa: SIM115 - closed in _close
            self._files[k].write(_header(self.shards[k], self.metadata))

    def _close(self, k: int) -> None:
        f = self._files.pop(k, None)
        if f is None:
            return
        path = self.stage_dir / self.names[k]
        with _naming(path, "write"):
            try:
                f.flush()
                os.fsync(f.fileno())
            finally:
                f.close()

    # ---- publishing ----------------------------------------------------------------------------
    def publish(self) -> ExportResult:
        """Complete the staged folder (the index) and make it ``out_dir``
        (``publish.py``: swapped in whole, or moved in place); an earlier export's
        shards that this one does not overwrite go."""
        if self._pos != len(self._order):
            missing = self._order[self._pos][1].name
            raise CheckpointError(
                f"export: only {self._pos} of {self.count} tensors were written (next: {missing!r})"
            )
        # Empty shards (a model with no tensors) still get their header.
        for k in range(len(self.shards)):
            if not (self.stage_dir / self.names[k]).exists():
                self._open(k)
                self._close(k)
        out, stage = self.out_dir, self.stage_dir
        idx = index_name(self.weights_name)
        if self.sharded:
            weight_map = {s.name: self.names[k] for k, s in self._order}
            doc = {
                "metadata": {**self.index_metadata, "total_size": self.total_size},
                "weight_map": weight_map,
            }
            with _naming(stage / idx, "write"):
                atomic.write_bytes_atomic(
                    stage / idx, (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()
                )
        weights = set(self.names)
        extra = sorted(p.name for p in stage.iterdir() if p.name not in weights and p.name != idx)
        pattern = _shard_pattern(self.weights_name)
        if self.swap:

            def earlier_export(name: str) -> bool:  # weights this export replaces or drops
                return name in (idx, self.weights_name) or pattern.fullmatch(name) is not None

            export_publish.publish_swap(stage, out, earlier_export, _naming)
        else:
            single = self.weights_name if self.sharded else None
            export_publish.publish_in_place(stage, out, self.names, idx, single, _naming)
            export_publish.remove_stale_shards(out, pattern, weights)
            shutil.rmtree(stage, ignore_errors=True)
        index = out / idx if self.sharded else None
        return ExportResult(
            out,
            [out / n for n in self.names],
            index,
            self.total_size,
            self.count,
            [out / n for n in extra],
        )

    def abort(self) -> None:
        """Drop everything staged; ``out_dir`` keeps what it had."""
        for f in self._files.values():
            with contextlib.suppress(OSError):
                f.close()
        self._files.clear()
        shutil.rmtree(self.stage_dir, ignore_errors=True)


@contextlib.contextmanager
def _naming(path: Path, what: str):
    """An OS error while working on ``path`` as a CheckpointError naming it."""
    try:
        yield
    except CheckpointError:
        raise
    except OSError as e:
        why = "no space left on device" if e.errno == errno.ENOSPC else (e.strerror or str(e))
        raise CheckpointError(f"{path}: cannot {what} ({why}); the export was not published") from e


def write_stream(
    writer: ShardWriter, stream: Iterable[tuple[str, torch.Tensor]], before_publish=None
) -> ExportResult:
    """Feed every (name, tensor) of ``stream`` to ``writer`` and publish; on any error the staged
    files are removed and the error re-raised."""
    try:
        for name, t in stream:
            writer.add(name, t)
        if before_publish is not None:
            before_publish(writer.stage_dir)
        return writer.publish()
    except BaseException:
        writer.abort()
        raise


# ---- engine streams (stage 0-3) ----------------------------------------------------------------
def _agree(engine, err: BaseException | None, what: str) -> None:
    """Every rank raises if any rank failed ``what`` (a failing rank raises its own error)."""
    from ..collective import agree

    agree(getattr(engine, "device", torch.device("cpu")), err, what)


@dataclass
class Item:
    """One tensor of an engine export: its output name, dtype and shape, the params whose stage-3
    slots must be gathered before ``value()`` is called, and ``value`` (rank 0 only)."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    needs: tuple = ()
    value: Callable[[], torch.Tensor] = lambda: None  # type: ignore[assignment, return-value]

    @property
    def spec(self) -> Spec:
        return Spec(self.key, self.dtype, self.shape)


def full_shape(t: torch.Tensor) -> tuple[int, ...]:
    """A param's full shape, partitioned (stage 3) or not."""
    shape = getattr(t, "ds_shape", None)
    return tuple(int(d) for d in (shape if shape is not None else t.shape))


def _slots_of(params) -> list[int]:
    out: list[int] = []
    for p in params:
        i = partitioned.slot_of(p)
        if i is not None and i not in out:
            out.append(i)
    return out


def gathered(engine, items: Sequence[Item]) -> Iterator[Item]:
    """Yield each item with the stage-3 slots of its ``needs`` gathered; between items, release
    the slots this walk gathered that the next item does not need. Below stage 3 (no param store)
    the items come as they are. A collective at stage 3: every rank walks the same items."""
    store = getattr(engine, "param_store", None) if getattr(engine, "stage", 0) == 3 else None
    if store is None:
        yield from items
        return
    from ...core.status import ZeroParamStatus

    store.quiesce()
    mine: set[int] = set()
    try:
        for n, item in enumerate(items):
            slots = _slots_of(item.needs)
            for s in slots:
                if store.slots[s].status is ZeroParamStatus.NOT_AVAILABLE:
                    store.start(s)
                    mine.add(s)
            for s in slots:
                store.wait(s)
            yield item
            keep = set(_slots_of(items[n + 1].needs)) if n + 1 < len(items) else set()
            for s in sorted(mine - keep):
                store.release(s, force=True)
                mine.discard(s)
    finally:
        for s in sorted(mine):
            store.release(s, force=True)


def state_dict_items(
    module: torch.nn.Module, exclude_frozen: bool = False, tied: str = "all"
) -> list[Item]:
    """Every key of ``module.state_dict()`` in its order, as trained (the training dtype; buffers
    in theirs). ``tied="all"``: a tied param under each of its names (DeepSpeed's 16-bit save);
    ``"once"``: under its first name only (save_pretrained's)."""
    from ..module_state import frozen_param_names

    sd = module.state_dict(keep_vars=True)
    frozen = frozen_param_names(module) if exclude_frozen else set()
    seen: set[int] = set()
    items = []
    for key, t in sd.items():
        if key in frozen:
            continue
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(
                f"module state dict entry {key!r} is a {type(t).__name__}, not a tensor; exports "
                "hold tensors only (extra state is not supported)"
            )
        if id(t) in seen and tied == "once":
            continue
        seen.add(id(t))
        items.append(_plain_item(key, t))
    return items


def _plain_item(key: str, t: torch.Tensor) -> Item:
    needs = (t,) if isinstance(t, torch.nn.Parameter) else ()
    return Item(key, t.dtype, full_shape(t), needs, lambda t=t: t.detach())


def stream_to_rank0(engine, items: Sequence[Item], consume: Callable[[Item], None]) -> None:
    """Walk ``items`` on every rank (the stage-3 gathers), calling ``consume(item)`` on rank 0.
    A failure in ``consume`` stops the consuming but not the walk (the other ranks are still
    gathering); every rank then raises (rank 0 its own error)."""
    rank = getattr(engine, "global_rank", 0)
    err: BaseException | None = None
    for item in gathered(engine, items):
        if rank == 0 and err is None:
            try:
                consume(item)
            except Exception as e:  # keep walking: the other ranks wait in the next gather
                err = e
    _agree(engine, err, "export")


def export_items(
    engine,
    items: Sequence[Item],
    out_dir,
    max_shard_size: int | str | None = DEFAULT_MAX_SHARD_SIZE,
    weights_name: str = WEIGHTS_NAME,
    index_metadata: dict | None = None,
    before_publish: Callable[[Path], None] | None = None,
) -> ExportResult | None:
    """Write ``items`` from rank 0 in the sharded layout (a collective at stage 3); returns the
    result on rank 0, None elsewhere. ``before_publish(stage_dir)`` may add files (config.json)."""
    rank = getattr(engine, "global_rank", 0)
    writer: ShardWriter | None = None
    err: BaseException | None = None
    if rank == 0:
        try:
            writer = ShardWriter(
                out_dir,
                [it.spec for it in items],
                max_shard_size,
                weights_name,
                index_metadata=index_metadata,
            )
        except Exception as e:
            err = e
    _agree(engine, err, "export preparation")

    def consume(item: Item) -> None:
        writer.add(item.key, item.value())

    try:
        stream_to_rank0(engine, items, consume)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    result = None
    if rank == 0:
        try:
            if before_publish is not None:
                before_publish(writer.stage_dir)
            result = writer.publish()
        except Exception as e:
            writer.abort()
            err = e
    _agree(engine, err, "export publishing")
    return result


def consolidated_state_dict(engine, exclude_frozen: bool = False) -> dict[str, torch.Tensor] | None:
    """DeepSpeed's ``_zero3_consolidated_16bit_state_dict``, streamed: rank 0 gets the module's
    state dict (training dtype, host copies, a tied param one tensor under each of its names);
    the other ranks hold one gathered slot at a time, never the model, and get None."""
    items = state_dict_items(engine.module, exclude_frozen, tied="all")
    out: dict[str, torch.Tensor] = {}
    copies: dict[int, torch.Tensor] = {}

    def consume(item: Item) -> None:
        t = item.value()
        key = id(item.needs[0]) if item.needs else None
        if key is not None and key in copies:
            out[item.key] = copies[key]
            return
        c = t.to("cpu", copy=True)
        if key is not None:
            copies[key] = c
        out[item.key] = c

    stream_to_rank0(engine, items, consume)
    return out if getattr(engine, "global_rank", 0) == 0 else None
