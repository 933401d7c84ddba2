"""Stage 3: which params form one fetch unit, and the layout that gives each unit its bucket.

A param's unit is the first module (in ``module.modules()`` order) that owns it directly; a tied
param owned by two modules belongs to the first, and the second fetches that unit too.
"""

from __future__ import annotations

import torch

from .flat_group import FlatGroup
from .layout import FlatLayout, build_unit_layout


def unit_ids(module: torch.nn.Module) -> dict[int, int]:
    """id(param) -> index of the module that owns it directly."""
    owner: dict[int, int] = {}
    for mi, m in enumerate(module.modules()):
        for p in m._parameters.values():
            if p is not None:
                owner.setdefault(id(p), mi)
    return owner


def full_numel(p: torch.Tensor) -> int:
    """A param's element count, also while it is partitioned (``p.numel() == 0``)."""
    return int(getattr(p, "ds_numel", p.numel()))


def unit_layout(params: list, units: dict[int, int], world_size: int) -> FlatLayout:
    """The flat layout of a group (``params`` in registration order) with a bucket per unit."""
    flat = FlatGroup.flat_order(params)
    return build_unit_layout(
        [full_numel(p) for p in flat], [units.get(id(p), -1) for p in flat], world_size
    )


def move_buffers(module: torch.nn.Module, device: torch.device) -> None:
    """Buffers go to the compute device in their own dtype (params are partitioned instead)."""
    for m in module.modules():
        for name, b in m._buffers.items():
            if b is not None and b.device != device:
                m._buffers[name] = b.to(device)
