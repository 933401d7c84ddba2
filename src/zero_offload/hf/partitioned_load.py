"""A Hugging Face folder's weights streamed into a model built under ``zero.Init``: each rank
reads, from the memory-mapped safetensors shards, only the rows that hold its own chunk of each
param, converts them to the param's dtype and writes them into ``p.ds_tensor``. No rank ever
holds a whole weight, let alone the whole model; the engine then lays the chunks out one param
at a time.

Buffers in the files (persistent ones) are small and read whole; buffers an ``__init__``
computes (rotary tables) are left as computed, as ``from_pretrained`` leaves them.

The rule: the load gives ``from_pretrained``'s model or refuses, naming the tensor and the
file. Tensors are found where the files hold them (``weight_files.py``); tied pairs the files
hold apart were untied before the model was built (``tied.py``); a param no file holds is a
:class:`WeightFileError` unless the architecture declares it optional
(``_keys_to_ignore_on_load_missing``). Every rank reads the same files, so every rank raises
the same error.
"""

from __future__ import annotations

import logging
import math
import os
import re

import torch

from ..core import partitioned
from .weight_files import WeightFileError, WeightFiles, find_weights

log = logging.getLogger("zero_offload")


def _chunk(view, spec) -> torch.Tensor:
    """Elements [lo, hi) of the flattened tensor, reading only the rows that hold them."""
    shape = view.get_shape()
    if spec.hi <= spec.lo:
        return torch.empty(0)
    if len(shape) <= 1:
        return view[spec.lo : spec.hi].reshape(-1)
    row = math.prod(shape[1:])
    first, last = spec.lo // row, math.ceil(spec.hi / row)
    rows = view[first:last].reshape(-1)
    return rows[spec.lo - first * row : spec.hi - first * row]


def stream_into(model: torch.nn.Module, folder: str | os.PathLike[str] | WeightFiles) -> None:
    """Fill ``model`` (built under ``zero.Init``) from ``folder``'s safetensors, this rank's
    chunks only (see the module's rule). Names in the files the model does not have are
    ignored with one warning, as ``from_pretrained`` does."""
    from safetensors import safe_open

    found = folder if isinstance(folder, WeightFiles) else find_weights(folder)
    params = dict(model.named_parameters(remove_duplicate=False))
    _check_complete(model, params, found)
    buffers = dict(model.named_buffers())
    loaded: set[int] = set()
    unknown = []
    by_file: dict = {}
    for name, path in found.where.items():
        by_file.setdefault(path, []).append(name)
    with torch.no_grad():
        for path, names in by_file.items():
            with safe_open(str(path), "pt") as f:
                for name in names:
                    p = params.get(name)
                    if p is not None and id(p) not in loaded:
                        _load_param(p, f.get_slice(name), name, path)
                        loaded.add(id(p))
                    elif name in buffers:
                        buf = buffers[name]
                        buf.copy_(f.get_tensor(name).to(buf.dtype))
                    elif p is None:
                        unknown.append(name)
    if unknown:
        log.warning(
            "%s: in the files but not in the model (ignored): %s", found.folder, unknown[:8]
        )


def _check_complete(model, params: dict[str, torch.nn.Parameter], found: WeightFiles) -> None:
    """Every param is held by the files under one of its names, or declared optional."""
    held = {id(p) for n, p in params.items() if n in found.where}
    optional = getattr(model, "_keys_to_ignore_on_load_missing", None) or ()
    pattern = re.compile("|".join(f"({p})" for p in optional)) if optional else None
    missing = [n for n, p in params.items() if id(p) not in held]
    required = [n for n in missing if pattern is None or not pattern.search(n)]
    if required:
        raise WeightFileError(
            f"{required[0]}: {found.describe_missing(required[0])}"
            + (
                f" ({len(required) - 1} more params missing: {required[1:6]})"
                if required[1:]
                else ""
            )
            + "; the model would train from its random init"
        )
    if missing:
        log.warning(
            "%s: not in the files, optional for this architecture (initial values kept): %s",
            found.folder,
            missing[:8],
        )


def _load_param(p: torch.nn.Parameter, view, name: str, path) -> None:
    shape = tuple(view.get_shape())
    want = tuple(getattr(p, "ds_shape", p.shape))
    if shape != want:
        raise WeightFileError(f"{name}: {path} holds shape {list(shape)}, the model {list(want)}")
    spec = partitioned.init_shard(p)
    if spec is None:  # not partitioned (zero.Init leaves integer params whole)
        p.data.copy_(view[:].to(p.dtype))
        return
    p.ds_tensor.copy_(_chunk(view, spec).to(p.ds_tensor.dtype))
