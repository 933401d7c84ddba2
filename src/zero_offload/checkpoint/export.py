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
                    ckpt.require_tensor(f, shard_tensor(g.index, "master"), "F32", (g.shard_numel,))
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
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.tmp")
    with _open(checkpoint_dir, tag) as ckpt:
        write_file(tmp, _entries(ckpt, dtype, exclude_frozen_parameters), {"format": "pt"})
    os.replace(tmp, out_path)
    fsync_dir(out_path.parent)
    return out_path


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
