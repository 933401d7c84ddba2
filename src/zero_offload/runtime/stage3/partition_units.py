"""Stage 3: which params form one fetch unit, and the layout that gives each unit its bucket.

A param's unit is the first module (in ``module.modules()`` order) that owns it directly; a tied
param owned by two modules belongs to the first, and the second fetches that unit too. A leaf
module (``partitioned.is_leaf_module``, a Mixture-of-Experts block) is one unit with its whole subtree.
"""

from __future__ import annotations

import torch

from ...core import partitioned
from ...core.flat_group import FlatGroup
from ...core.layout import FlatLayout, build_unit_layout


def scheduled_modules(module: torch.nn.Module) -> list[tuple[torch.nn.Module, list]]:
    """(module, the params it fetches) for every module that gets fetch hooks, in
    ``module.modules()`` order: a module fetches the params it owns directly; a leaf module
    (``partitioned.is_leaf_module``) fetches its whole subtree's, and its descendants are not scheduled."""
    out: list[tuple[torch.nn.Module, list]] = []

    def visit(m: torch.nn.Module) -> None:
        if partitioned.is_leaf_module(m):
            params = list(dict.fromkeys(m.parameters()))
            for p in params:
                p.ds_z3_leaf_module = m
            out.append((m, params))
            return
        out.append((m, [p for p in m._parameters.values() if p is not None]))
        for child in m.children():
            visit(child)

    visit(module)
    seen: set[int] = set()  # a module reachable twice (shared) is scheduled once
    return [(m, ps) for m, ps in out if not (id(m) in seen or seen.add(id(m)))]


def unit_ids(module: torch.nn.Module) -> dict[int, int]:
    """id(param) -> index (among the scheduled modules) of the module that fetches it."""
    owner: dict[int, int] = {}
    for mi, (_, params) in enumerate(scheduled_modules(module)):
        for p in params:
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
