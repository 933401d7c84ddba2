"""A Hugging Face folder's weights streamed into a model built under ``zero.Init``: each rank
reads, from the memory-mapped safetensors shards, only the rows that hold its own chunk of each
param, converts them to the param's dtype and writes them into ``p.ds_tensor``. No rank ever
holds a whole weight, let alone the whole model; the engine then lays the chunks out one param
at a time.

Buffers in the files (persistent ones) are small and read whole; buffers an ``__init__``
computes (rotary tables) are left as computed, as ``from_pretrained`` leaves them.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

import torch

log = logging.getLogger("zero_offload")

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def weight_files(folder: str | os.PathLike[str]) -> dict[str, Path]:
    """{tensor name: the safetensors file holding it}, from the index or the single file."""
    folder = Path(folder)
    if (folder / INDEX).is_file():
        weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    if (folder / SINGLE).is_file():
        from safetensors import safe_open

        with safe_open(str(folder / SINGLE), "pt") as f:
            return {name: folder / SINGLE for name in f.keys()}  # noqa: SIM118 (not a dict)
    raise FileNotFoundError(
        f"{folder}: no {SINGLE} or {INDEX}; give a folder save_pretrained wrote with safetensors"
    )


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


def stream_into(model: torch.nn.Module, folder: str | os.PathLike[str]) -> None:
    """Fill ``model`` (built under ``zero.Init``) from ``folder``'s safetensors, this rank's
    chunks only. A param missing from the files keeps its initial value, with one warning;
    a name in the files the model does not have is named in the same warning."""
    from safetensors import safe_open

    files = weight_files(folder)
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers())
    loaded: set[int] = set()
    unknown = []
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        by_file.setdefault(path, []).append(name)
    with torch.no_grad():
        for path, names in by_file.items():
            with safe_open(str(path), "pt") as f:
                for name in names:
                    p = params.get(name)
                    if p is not None and id(p) not in loaded:
                        _load_param(p, f.get_slice(name), name)
                        loaded.add(id(p))
                    elif name in buffers:
                        buf = buffers[name]
                        buf.copy_(f.get_tensor(name).to(buf.dtype))
                    elif p is None:
                        unknown.append(name)
    missing = [n for n, p in params.items() if id(p) not in loaded]
    if missing or unknown:
        log.warning(
            "%s: %s%s",
            folder,
            f"not in the files (keep their initial values): {missing[:8]} " if missing else "",
            f"in the files but not in the model (ignored): {unknown[:8]}" if unknown else "",
        )


def _load_param(p: torch.nn.Parameter, view, name: str) -> None:
    shape = tuple(view.get_shape())
    want = tuple(getattr(p, "ds_shape", p.shape))
    if shape != want:
        raise ValueError(f"{name}: the files hold shape {list(shape)}, the model {list(want)}")
    spec = getattr(p, "_z3_init", None)
    if spec is None:  # not partitioned (zero.Init leaves integer params whole)
        p.data.copy_(view[:].to(p.dtype))
        return
    p.ds_tensor.copy_(_chunk(view, spec).to(p.ds_tensor.dtype))
