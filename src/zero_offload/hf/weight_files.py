"""Where each tensor of a Hugging Face folder is, found as ``from_pretrained`` finds it: by the
keys of the safetensors files themselves. The index only says which files make up the model; a
tensor the index omits or maps to the wrong shard is found in the shard that holds it.

Invariants of :func:`find_weights` on return:
- every file it names opened as a complete safetensors file (a truncated or damaged file is a
  :class:`WeightFileError` naming it, before any weight is read);
- ``where[name]`` is a file whose header holds ``name``; when two files hold a name, the one
  the index names wins.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class WeightFileError(ValueError):
    """A model folder's weight files cannot give ``from_pretrained``'s model: names the file
    (and the tensor, where one is concerned)."""


@dataclass
class WeightFiles:
    folder: Path
    where: dict[str, Path] = field(default_factory=dict)  # tensor name -> file holding it
    index: Path | None = None
    claimed: dict[str, str] = field(default_factory=dict)  # the index's weight_map

    def describe_missing(self, name: str) -> str:
        """Why ``name`` is not found, for an error message."""
        if name in self.claimed:
            return (
                f"{self.index} maps it to {self.claimed[name]}, but no shard of the index holds it"
            )
        files = sorted({p.name for p in self.where.values()})
        return f"no file of {self.folder} holds it (looked in {', '.join(files) or 'none'})"


def find_weights(folder: str | os.PathLike[str]) -> WeightFiles:
    """The folder's tensors and the files that hold them (see the module's invariants)."""
    folder = Path(folder)
    if (folder / INDEX).is_file():
        return _from_index(folder, folder / INDEX)
    if (folder / SINGLE).is_file():
        found = WeightFiles(folder)
        for name in tensor_names(folder / SINGLE):
            found.where[name] = folder / SINGLE
        return found
    raise FileNotFoundError(
        f"{folder}: no {SINGLE} or {INDEX}; give a folder save_pretrained wrote with safetensors"
    )


def tensor_names(path: Path) -> list[str]:
    """The tensors in ``path``'s header; a file that is not a complete safetensors file (cut
    short, damaged header) is an error naming it."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return list(f.keys())
    except FileNotFoundError:
        raise
    except Exception as exc:  # SafetensorError derives from Exception only
        raise WeightFileError(
            f"{path}: not a complete safetensors file ({exc}); the file is truncated or "
            "damaged: copy or download it again"
        ) from None


def _from_index(folder: Path, index: Path) -> WeightFiles:
    try:
        claimed = json.loads(index.read_text())["weight_map"]
        if not isinstance(claimed, dict):
            raise TypeError("weight_map is not an object")
    except (ValueError, KeyError, TypeError) as exc:
        raise WeightFileError(
            f"{index}: not a safetensors index (a JSON object with a weight_map of tensor "
            f"name -> file): {exc}"
        ) from None
    found = WeightFiles(folder, index=index, claimed=claimed)
    for file in sorted(set(claimed.values())):
        path = folder / file
        if not path.is_file():
            raise WeightFileError(f"{index} names {file}, which is not in {folder}")
        for name in tensor_names(path):
            if name not in found.where or claimed.get(name) == file:
                found.where[name] = path
    return found
