"""``deepspeed.checkpoint.utils``: ``clone_tensors_for_torch_save`` (accelerate saves a state
dict through it)."""

from __future__ import annotations

import torch

from .._common import not_provided_getattr

__all__ = ["clone_tensors_for_torch_save"]
__getattr__ = not_provided_getattr(__name__)


_CPU = torch.device("cpu")


def clone_tensors_for_torch_save(item, device=_CPU):
    """DeepSpeed's: ``item`` with every tensor (nested in lists, tuples, dicts) replaced by a
    detached copy on ``device``, so saving it writes each tensor alone, not the storage it views."""
    if torch.is_tensor(item):
        device = torch.device(device)
        return item.detach().clone() if item.device == device else item.detach().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item
