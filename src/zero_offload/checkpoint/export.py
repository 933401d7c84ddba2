"""Consolidation: one plain state dict from a checkpoint, without an engine or a process group.

Every key of the module's state dict comes back under the module's own name (tied names each
present): trainable params as their fp32 master weights, assembled from every rank's shard by the
same re-slicing the loader uses, and frozen params and buffers as the model file saved them
(floating ones cast to the requested dtype). ``export_safetensors`` streams the result into one
safetensors file a tensor at a time, so host memory holds one tensor, not the model.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .atomic import fsync_dir
from .format import MODEL_FILE, CheckpointError, CheckpointNotFoundError, shard_tensor
from .reader import CheckpointReader, GroupMeta
from .tensor_file import DTYPES, Entry, write_file


def _open(checkpoint_dir, tag) -> CheckpointReader:
    from .deepspeed import is_deepspeed_checkpoint

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
    def build() -> torch.Tensor:
        if len(pieces) == 1:  # the param lies whole in one shard: the slice read is the tensor
            f, src, _, n = pieces[0]
            return (
                ckpt.read_slice(f, shard_tensor(group, "master"), src, src + n)
                .view(shape)
                .to(dtype)
            )
        out = torch.empty(numel, dtype=torch.float32)
        for f, src, dst, n in pieces:
            out[dst : dst + n].copy_(
                ckpt.read_slice(f, shard_tensor(group, "master"), src, src + n)
            )
        return out.view(shape).to(dtype)

    return build


def _model_reader(ckpt, name: str, dtype: torch.dtype):
    return lambda: ckpt.read_tensor(MODEL_FILE, name).to(dtype)


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
    ``out_path`` as safetensors, one tensor at a time; floating tensors in ``dtype``."""
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
    out_path = Path(out_path)
    with _open(checkpoint_dir, tag) as ckpt:
        entries = _entries(ckpt, dtype, exclude_frozen_parameters)
        _make_parent(out_path)
        tmp = out_path.with_name(f".{out_path.name}.tmp")
        try:
            write_file(tmp, entries, {"format": "pt"})
            os.replace(tmp, out_path)
            fsync_dir(out_path.parent)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise CheckpointError(
                f"{out_path}: cannot write the export ({e.strerror or e}); expected a writable "
                "file path whose folder exists or can be created"
            ) from None
    return out_path


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
    checkpoint_dir, output_dir, tag: str | None = None, exclude_frozen_parameters: bool = False
) -> Path:
    """DeepSpeed's name: write ``<output_dir>/model.safetensors`` (fp32)."""
    return export_safetensors(
        checkpoint_dir,
        Path(output_dir) / "model.safetensors",
        tag,
        torch.float32,
        exclude_frozen_parameters,
    )
