"""Tied weights whose files disagree: ``from_pretrained`` (transformers 5) unties a pair the
config ties when the files hold both tensors with different values, and keeps both. The
partitioned load must build that same model, so this is decided before the model is built,
from the files alone (the same answer on every rank).

Invariant: after :func:`untie_stored_apart`, every group of names that share one param in the
model the config builds is either held by the files at most once, or held with equal values
under each name; otherwise the config was untied (a warning says so) or a
:class:`WeightFileError` names the tensors and files.
"""

from __future__ import annotations

import logging
import math

import torch

from .weight_files import WeightFileError, WeightFiles

log = logging.getLogger("zero_offload")

ROWS_BYTES = 16 << 20  # the comparison reads this much of each tensor at a time


def alias_groups(transformers, config) -> list[list[str]]:
    """Names that share one param in the model ``config`` builds (built on the meta device: no
    memory, no init)."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def untie_stored_apart(transformers, config, found: WeightFiles) -> None:
    """Untie ``config`` (``tie_word_embeddings``) where the files hold a tied pair apart."""
    apart = [pair for g in alias_groups(transformers, config) if (pair := _differing(g, found))]
    if not apart:
        return
    pairs = ", ".join(
        f"{a} ({found.where[a].name}) and {b} ({found.where[b].name})" for a, b in apart
    )
    if getattr(config, "tie_word_embeddings", False):
        config.tie_word_embeddings = False
        if not alias_groups(transformers, config):
            log.warning(
                "%s: config.json ties %s, but the files hold them with different values: "
                "loaded untied, as from_pretrained does (set tie_word_embeddings false in "
                "config.json to silence this)",
                found.folder,
                pairs,
            )
            return
    raise WeightFileError(
        f"{found.folder}: the model ties {pairs}, but the files hold them with different "
        "values and the config has no tie to turn off; keep one of them in the files"
    )


def _differing(names: list[str], found: WeightFiles) -> tuple[str, str] | None:
    stored = [n for n in names if n in found.where]
    for other in stored[1:]:
        if not _same_tensor(found, stored[0], other):
            return stored[0], other
    return None


def _same_tensor(found: WeightFiles, a: str, b: str) -> bool:
    """Whether the files hold equal values under ``a`` and ``b``, read a block of rows at a
    time (host memory bounded by ``ROWS_BYTES`` per tensor)."""
    from safetensors import safe_open

    with (
        safe_open(str(found.where[a]), "pt") as fa,
        safe_open(str(found.where[b]), "pt") as fb,
    ):
        va, vb = fa.get_slice(a), fb.get_slice(b)
        shape = va.get_shape()
        if shape != vb.get_shape() or va.get_dtype() != vb.get_dtype():
            return False
        if len(shape) == 0:
            return torch.equal(fa.get_tensor(a), fb.get_tensor(b))
        row_bytes = max(1, math.prod(shape[1:]) * 8)
        step = max(1, ROWS_BYTES // row_bytes)
        return all(
            torch.equal(va[i : i + step], vb[i : i + step]) for i in range(0, shape[0], step)
        )
