"""Consolidation: one plain state dict from a checkpoint, without an engine or a process group.

Every key of the module's state dict comes back under the module's own name (tied names each
present): trainable params as their fp32 master weights, assembled from every rank's shard by the
same re-slicing the loader uses, and frozen params and buffers as the model file saved them
(floating ones cast to the requested dtype). ``export_sharded`` streams the result into Hugging
Face's (sharded) safetensors layout and ``export_safetensors`` into one file, a tensor at a time:
each tensor is read from the checkpoint with plain reads (not a memory map, whose pages would stay
in the process's resident memory until the export ends), written, and dropped, so host memory
holds about one tensor, not the model.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import torch

from ..format import MODEL_FILE, CheckpointError, CheckpointNotFoundError, shard_tensor
from ..module_state import tied_patterns
from ..read.reader import CheckpointReader, GroupMeta
from ..tensor_file import DTYPES, Entry
from .sharded import (
    DEFAULT_MAX_SHARD_SIZE,
    WEIGHTS_NAME,
    ExportResult,
    ShardWriter,
    Spec,
    write_stream,
)


def _open(checkpoint_dir, tag) -> CheckpointReader:
    from ..deepspeed import is_deepspeed_checkpoint

    if is_deepspeed_checkpoint(checkpoint_dir, tag):
        raise CheckpointError(
            f"{checkpoint_dir} is a DeepSpeed checkpoint, not this project's format; convert it "
            f"once with: zero-offload convert-deepspeed {checkpoint_dir} CONVERTED_DIR, then "
            "export CONVERTED_DIR"
        )
    ckpt = CheckpointReader.open(Path(checkpoint_dir), tag)
    if ckpt is None:
        raise CheckpointNotFoundError(
            f"{Path(checkpoint_dir) / 'latest'}: file is missing; pass tag= to name a checkpoint"
        )
    return ckpt


def _entries(ckpt: CheckpointReader, dtype: torch.dtype, exclude_frozen: bool) -> list[Entry]:
    """One lazily produced Entry per state-dict key; verifies every byte they will read first."""
    model = ckpt.meta["model"]
    aliases, frozen = dict(model.get("aliases", {})), set(model.get("frozen", []))
    trainable: dict[str, tuple[GroupMeta, int]] = {}
    for g in ckpt.groups:
        for i, name in enumerate(g.names):
            trainable[name] = (g, i)
    plans: dict[str, list] = {}
    ranges: dict[str, list[tuple[int, int]]] = {}
    entries = []
    for key in model.get("keys", []):
        if exclude_frozen and key in frozen:
            continue
        target = aliases.get(key, key)
        if target in trainable:
            g, i = trainable[target]
            shape, numel = g.shapes[i], g.layout.numels[i]
            if target not in plans:
                try:
                    plans[target] = ckpt.param_pieces(g, target, numel)
                except ValueError as e:
                    raise CheckpointError(f"{ckpt.path / 'meta.json'}: {e}") from None
                for f, src, _, n in plans[target]:
                    ckpt.require_shard(g, f, "master")
                    ranges.setdefault(f, []).append(
                        ckpt.tensor_range(f, shard_tensor(g.index, "master"), src, src + n)
                    )
            entries.append(
                Entry(
                    key, dtype, shape, _assembler(ckpt, g.index, plans[target], numel, shape, dtype)
                )
            )
        else:
            info = ckpt.require_tensor(MODEL_FILE, target, None, None)
            if info.dtype not in DTYPES:
                raise CheckpointError(
                    f"{ckpt.path / MODEL_FILE}: tensor {target!r} has unsupported dtype {info.dtype}"
                )
            stored = DTYPES[info.dtype]
            out = dtype if stored.is_floating_point else stored
            ranges.setdefault(MODEL_FILE, []).append(ckpt.tensor_range(MODEL_FILE, target))
            entries.append(Entry(key, out, info.shape, _model_reader(ckpt, target, out)))
    for f, r in ranges.items():
        ckpt.verify(f, r)
    for f in ranges:  # each rank file read: written under meta.json's layout?
        if f != MODEL_FILE:
            ckpt.check_layout(f)
    return entries


def _assembler(ckpt, group: int, pieces, numel: int, shape, dtype: torch.dtype):
    tensor = shard_tensor(group, "master")

    def build() -> torch.Tensor:
        out = torch.empty(numel, dtype=torch.float32)
        for f, src, dst, n in pieces:
            lo, hi = ckpt.tensor_range(f, tensor, src, src + n)
            _read_into(ckpt, f, lo, hi, out[dst : dst + n], tensor)
        return out.view(shape).to(dtype)

    return build


def _model_reader(ckpt, name: str, dtype: torch.dtype):
    def read() -> torch.Tensor:
        info = ckpt.header(MODEL_FILE).tensors[name]
        out = torch.empty(info.shape, dtype=DTYPES[info.dtype])
        lo, hi = ckpt.tensor_range(MODEL_FILE, name)
        _read_into(ckpt, MODEL_FILE, lo, hi, out.reshape(-1), name)
        return out.to(dtype)

    return read


def _read_into(ckpt, name: str, lo: int, hi: int, out: torch.Tensor, tensor: str) -> None:
    """File bytes [lo, hi) of ``name`` into the contiguous CPU tensor ``out`` with plain reads
    (safetensors data is little-endian: on a big-endian host, through safetensors instead)."""
    if hi - lo != out.numel() * out.element_size():
        raise CheckpointError(f"{ckpt.path / name}: tensor {tensor!r} has an unexpected size")
    if out.numel() == 0:
        return
    if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
        itemsize = out.element_size()
        start = ckpt.header(name).data_start + ckpt.header(name).tensors[tensor].begin
        a, b = (lo - start) // itemsize, (hi - start) // itemsize
        if name == MODEL_FILE:
            out.copy_(ckpt.read_tensor(name, tensor).reshape(-1)[a:b])
        else:
            out.copy_(ckpt.read_slice(name, tensor, a, b))
        return
    view = memoryview(out.view(torch.uint8).numpy())
    with open(ckpt.path / name, "rb", buffering=0) as f:
        f.seek(lo)
        pos = 0
        while pos < len(view):
            got = f.readinto(view[pos:])
            if not got:
                raise CheckpointError(f"{ckpt.path / name}: truncated while reading {tensor!r}")
            pos += got


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir, tag: str | None = None, exclude_frozen_parameters: bool = False
) -> dict[str, torch.Tensor]:
    """The module's state dict with fp32 master weights, from ``<checkpoint_dir>/<tag>``
    (``latest``'s tag when None; ``checkpoint_dir`` may also be a tag directory). Tied keys map
    to the same tensor."""
    with _open(checkpoint_dir, tag) as ckpt:
        aliases = dict(ckpt.meta["model"].get("aliases", {}))
        out: dict[str, torch.Tensor] = {}
        for e in _entries(ckpt, torch.float32, exclude_frozen_parameters):
            target = aliases.get(e.name, e.name)
            out[e.name] = out[target] if target in out else e.source()
        return out


def export_safetensors(
    checkpoint_dir,
    out_path,
    tag: str | None = None,
    dtype: torch.dtype = torch.float32,
    exclude_frozen_parameters: bool = False,
) -> Path:
    """Write the consolidated state dict (see ``get_fp32_state_dict_from_zero_checkpoint``) to
    ``out_path`` as one safetensors file, one tensor at a time; floating tensors in ``dtype``.
    Every key is present (a tied weight under each name), so ``load_state_dict(strict=True)``
    takes it. ``export_sharded`` writes Hugging Face's sharded layout."""
    out_path = Path(out_path)
    result = export_sharded(
        checkpoint_dir,
        out_path.parent,
        tag=tag,
        dtype=dtype,
        exclude_frozen_parameters=exclude_frozen_parameters,
        max_shard_size=None,
        weights_name=out_path.name,
    )
    return result.files[0]


def export_sharded(
    checkpoint_dir,
    out_dir,
    tag: str | None = None,
    dtype: torch.dtype = torch.float32,
    exclude_frozen_parameters: bool = False,
    max_shard_size: int | str | None = DEFAULT_MAX_SHARD_SIZE,
    weights_name: str = WEIGHTS_NAME,
    strip_prefix: str | None = None,
    hf_config=None,
) -> ExportResult:
    """Stream the consolidated state dict into ``out_dir`` in Hugging Face's layout:
    ``model-0000k-of-0000n.safetensors`` and ``model.safetensors.index.json`` (``metadata.
    total_size``, ``weight_map``), or one ``model.safetensors`` when it fits in one shard
    (``max_shard_size``: ``"5GB"``, ``"500MB"``, bytes; None: always one file). One tensor is
    read, written and dropped at a time; the files appear together (``sharded.py``).

    ``strip_prefix``: every key must start with it and loses it (``"model."`` for a checkpoint
    of ``zero-offload train --model``, whose module wraps the Hugging Face model as ``.model``).
    ``hf_config``: a Hugging Face model folder whose ``config.json`` (and
    ``generation_config.json``) are copied in, making ``out_dir`` a ``from_pretrained`` folder;
    the keys are then checked against that model class's (built on the meta device, no memory)
    and a tied weight is written once under the name transformers keeps, as ``save_pretrained``
    does. Without it every key is written, a tied weight under each name, so
    ``load_state_dict(strict=True)`` of the files' union works for any module."""
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
    out_dir = Path(out_dir)
    _make_parent(out_dir / weights_name)
    expect = _hf_expectations(Path(hf_config)) if hf_config is not None else None
    with _open(checkpoint_dir, tag) as ckpt:
        entries = _entries(ckpt, dtype, exclude_frozen_parameters)
        aliases = dict(ckpt.meta["model"].get("aliases", {}))
        entries = _renamed(entries, aliases, strip_prefix, expect, exclude_frozen_parameters)
        specs = [Spec(name, e.dtype, tuple(e.shape)) for name, e in entries]
        writer = ShardWriter(
            out_dir,
            specs,
            max_shard_size,
            weights_name,
            index_metadata=_total_parameters(ckpt, entries, aliases),
        )

        def copy_config(stage: Path) -> None:
            if hf_config is None:
                return
            for name in ("config.json", "generation_config.json"):
                src = Path(hf_config) / name
                if src.is_file():
                    shutil.copyfile(src, stage / name)

        return write_stream(
            writer, ((name, e.source()) for name, e in entries), before_publish=copy_config
        )


def _total_parameters(ckpt, entries, aliases) -> dict:
    params = set(ckpt.meta["model"].get("params", []))
    n = 0
    for _, e in entries:
        if e.name in params and aliases.get(e.name, e.name) == e.name:
            n += _numel(e.shape)
    return {"total_parameters": n}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


class _Expect:
    """What ``from_pretrained`` of the config's model class expects."""

    def __init__(self, where: Path, cls: str, keys: list[str], tied: list[list[str]], patterns):
        self.where, self.cls, self.keys, self.tied, self.patterns = (
            where,
            cls,
            keys,
            tied,
            patterns,
        )

    def keep(self, names: list[str]) -> str:
        """Of one tied weight's names, the one save_pretrained keeps."""
        untied = [n for n in names if not any(re.search(p, n) for p in self.patterns)]
        return untied[0] if untied else names[0]


def _hf_expectations(folder: Path) -> _Expect:
    if not (folder / "config.json").is_file():
        raise CheckpointError(
            f"{folder / 'config.json'}: file is missing; --hf-config needs a Hugging Face model "
            "folder (the one training started from, or the run folder's hf_model/)"
        )
    from ...hf.deps import require_transformers

    transformers = require_transformers()
    config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    with torch.device("meta"):
        model = (
            cls._from_config(config)
            if cls is not None
            else transformers.AutoModelForCausalLM.from_config(config)
        )
    by_id: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(n)
    tied = [names for names in by_id.values() if len(names) > 1]
    return _Expect(
        folder / "config.json",
        type(model).__name__,
        list(model.state_dict()),
        tied,
        tied_patterns(model),
    )


def _renamed(entries, aliases, prefix, expect: _Expect | None, exclude_frozen: bool):
    """(output name, entry) pairs: the prefix stripped, and with a Hugging Face config the keys
    checked against its model and tied duplicates left out as save_pretrained does."""
    if prefix:
        outside = [e.name for e in entries if not e.name.startswith(prefix)]
        if outside:
            raise CheckpointError(
                f"--strip-prefix {prefix!r}: {len(outside)} key(s) do not start with it, e.g. "
                f"{outside[0]!r}"
            )
    out = [(e.name[len(prefix) :] if prefix else e.name, e) for e in entries]
    if expect is None:
        return out
    names = [n for n, _ in out]
    expected = set(expect.keys)
    unexpected = [n for n in names if n not in expected]
    if unexpected:
        hint = _prefix_hint(names, expected)
        raise CheckpointError(
            f"--hf-config {expect.where}: {len(unexpected)} checkpoint key(s) are not "
            f"{expect.cls}'s, e.g. {unexpected[0]!r}"
            + (f"; they match with --strip-prefix {hint!r}" if hint else "")
        )
    # a tied weight (one tensor under several names in the checkpoint): keep transformers' name
    group_of: dict[str, list[str]] = {}
    original = {n: e.name for n, e in out}
    for n in names:
        canon = aliases.get(original[n], original[n])
        group_of.setdefault(canon, []).append(n)
    drop = set()
    for group in group_of.values():
        if len(group) > 1:
            kept = expect.keep(group)
            drop.update(n for n in group if n != kept)
    out = [(n, e) for n, e in out if n not in drop]
    if not exclude_frozen:
        have = {n for n, _ in out}
        covered = set(have)
        for group in expect.tied:
            if any(n in have for n in group):
                covered.update(group)
        missing = [k for k in expect.keys if k not in covered]
        if missing:
            raise CheckpointError(
                f"--hf-config {expect.where}: {expect.cls} has {len(missing)} key(s) the "
                f"checkpoint lacks, e.g. {missing[0]!r}; is it the model that was trained?"
            )
    return out


def _prefix_hint(names: list[str], expected: set[str]) -> str | None:
    first = names[0].split(".") if names else []
    for k in range(1, len(first)):
        prefix = ".".join(first[:k]) + "."
        if all(n.startswith(prefix) and n[len(prefix) :] in expected for n in names):
            return prefix
    return None


def _make_parent(out_path: Path) -> None:
    """Create ``out_path``'s folder, naming the path (and the file in the way) when it cannot."""
    try:
        out_path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        blocker = next((p for p in [out_path.parent, *out_path.parent.parents] if p.exists()), None)
        why = (
            f"{blocker} is a file, not a folder"
            if blocker is not None and not blocker.is_dir()
            else (e.strerror or str(e))
        )
        raise CheckpointError(
            f"{out_path}: cannot create its folder: {why}; expected an output path whose "
            "parents are folders (or do not exist yet)"
        ) from None


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir,
    output_dir,
    max_shard_size: int | str | None = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> list[Path]:
    """DeepSpeed 0.19.8's function, with its arguments and defaults: the fp32 state dict into
    ``output_dir`` as ``pytorch_model.bin`` (``model.safetensors`` with ``safe_serialization``),
    sharded past ``max_shard_size`` with Hugging Face's index. The same code as the
    ``zero_to_fp32.py`` every save puts into ``save_dir`` (``zero_to_fp32_script.py``). Returns
    the files written."""
    from ..scripts import zero_to_fp32_script as script

    script.parse_size(max_shard_size)  # a bad size fails before anything is read
    _open(checkpoint_dir, tag).close()  # this project's errors: DeepSpeed format, no ``latest``
    return script.convert_zero_checkpoint_to_fp32_state_dict(
        checkpoint_dir,
        output_dir,
        max_shard_size=max_shard_size,
        safe_serialization=safe_serialization,
        tag=tag,
        exclude_frozen_parameters=exclude_frozen_parameters,
    )
