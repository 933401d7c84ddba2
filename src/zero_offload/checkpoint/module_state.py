"""The module's state dict as a checkpoint sees it: tensors only, tied names recognised.

A tied weight (``head.weight = emb.weight``) appears under several state-dict keys that share one
storage. The checkpoint's model file stores it once, under its *canonical* key (the name the engine
knows the param by when it is trainable, else the first key), and ``meta.json`` maps every other
key to it; loading and export give every key its value again.
"""

from __future__ import annotations

import torch

from ..core.status import require_whole
from .format import CheckpointError


def module_state(module: torch.nn.Module, exclude_frozen: bool = False) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` (params and persistent buffers), refusing non-tensor entries and
    partitioned params (gather first: ``engine.params_on_host()``)."""
    require_whole(module, "module state dict")
    sd = module.state_dict()
    if exclude_frozen:
        frozen = frozen_param_names(module)
        sd = {k: v for k, v in sd.items() if k not in frozen}
    for k, v in sd.items():
        if not isinstance(v, torch.Tensor):
            raise CheckpointError(
                f"module state dict entry {k!r} is a {type(v).__name__}, not a tensor; checkpoints "
                "store module state as tensors only (extra state is not supported)"
            )
    return sd


def param_names(module: torch.nn.Module) -> list[str]:
    """Every state-dict key that names a parameter (tied ones under each of their names)."""
    return [n for n, _ in module.named_parameters(remove_duplicate=False)]


def frozen_param_names(module: torch.nn.Module) -> set[str]:
    return {n for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}


def _identity(t: torch.Tensor) -> tuple:
    return (
        t.device,
        t.untyped_storage().data_ptr(),
        t.storage_offset(),
        tuple(t.shape),
        tuple(t.stride()),
        t.dtype,
    )


def alias_map(sd: dict[str, torch.Tensor], prefer: set[str]) -> dict[str, str]:
    """{alias key: canonical key} for keys whose tensors are the same tensor (same storage,
    offset, shape, stride and dtype). The canonical key is one in ``prefer`` if any, else the
    first in state-dict order."""
    by_id: dict[tuple, list[str]] = {}
    for k, t in sd.items():
        if t.numel() == 0:
            continue  # empty tensors may share a null storage without being tied
        by_id.setdefault(_identity(t), []).append(k)
    out = {}
    for keys in by_id.values():
        if len(keys) > 1:
            canon = next((k for k in keys if k in prefer), keys[0])
            out.update({k: canon for k in keys if k != canon})
    return out


def tied_patterns(model: torch.nn.Module) -> list[str]:
    """transformers' declared tied-weight targets (the keys save_pretrained drops)."""
    out: list[str] = []
    for name, sub in model.named_modules():
        tied = getattr(sub, "_tied_weights_keys", None) or {}
        keys = tied.keys() if isinstance(tied, dict) else tied
        out += [f"{name}.{k}" if name else k for k in keys]
    return out
