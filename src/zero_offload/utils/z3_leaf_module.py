"""ZeRO-3 leaf modules, DeepSpeed's ``deepspeed.utils`` names.

A leaf module is fetched whole: its pre-forward hook gathers the params of its entire subtree at
once, and its descendants get no hooks. Mixture-of-Experts blocks need it: which experts run
depends on the data, so per-expert fetches would differ between ranks (a collective mismatch)
and between steps (no recorded order to prefetch by). Flag leaves before ``initialize`` (or
``zero.Init``'s engine) builds the stage-3 schedule; the ``zero_optimization.leaf_module`` config
key flags them at ``initialize``.
"""

from __future__ import annotations

import logging

import torch

from ..core import partitioned

log = logging.getLogger("zero_offload")


def z3_leaf_module(model: torch.nn.Module) -> bool:
    """Whether ``model`` is flagged as a leaf."""
    return partitioned.is_leaf_module(model)


def z3_leaf_parameter(model: torch.nn.Parameter) -> bool:
    """Whether a param belongs to a leaf module's subtree (set when a stage-3 engine is built)."""
    return hasattr(model, "ds_z3_leaf_module")


def get_z3_leaf_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if z3_leaf_module(m)]


def set_z3_leaf_module(model: torch.nn.Module, flag: bool) -> None:
    partitioned.set_leaf_module(model, flag)


def _qualified(module: torch.nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def _matches(module: torch.nn.Module, spec: type | str) -> bool:
    if isinstance(spec, type):
        return isinstance(module, spec)
    return type(module).__name__ == spec or _qualified(module) == spec


def _flag_classes(model, classes, flag: bool, raise_if_not_found: bool) -> list[torch.nn.Module]:
    if not all(isinstance(c, type | str) for c in classes):
        raise TypeError(
            f"leaf_module_classes must be a list of module classes or class names, got {classes!r}"
        )
    found = [m for m in model.modules() if any(_matches(m, c) for c in classes)]
    for m in found:
        partitioned.set_leaf_module(m, flag)
    if not found and raise_if_not_found:
        raise ValueError(
            f"No modules of type {list(classes)} found in model {type(model).__name__}"
        )
    return found


def set_z3_leaf_modules(
    model: torch.nn.Module, leaf_module_classes: list, raise_if_not_found: bool = True
) -> list[torch.nn.Module]:
    """Flag every module of ``model`` that is an instance of one of ``leaf_module_classes``
    (classes, or class names: bare or fully qualified) as a leaf; returns them."""
    return _flag_classes(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(
    model: torch.nn.Module, leaf_module_classes: list, raise_if_not_found: bool = True
) -> list[torch.nn.Module]:
    """Clear the leaf flag of the modules ``set_z3_leaf_modules`` would flag; returns them."""
    return _flag_classes(model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_modules_by_name(
    model: torch.nn.Module,
    module_names: list[str],
    flag: bool = True,
    raise_if_not_found: bool = True,
) -> tuple[list[torch.nn.Module], list[str]]:
    """Flag the modules named (as ``named_modules()`` names them); returns (found, missing)."""
    by_name = dict(model.named_modules())
    found = [by_name[n] for n in module_names if n in by_name]
    missing = [n for n in module_names if n not in by_name]
    for m in found:
        partitioned.set_leaf_module(m, flag)
    if missing and raise_if_not_found:
        raise ValueError(f"No modules named {missing} found in model {type(model).__name__}")
    return found, missing


def set_z3_leaf_modules_by_suffix(
    model: torch.nn.Module,
    module_name_suffixes: list[str],
    flag: bool = True,
    raise_if_not_found: bool = True,
) -> tuple[list[torch.nn.Module], list[str]]:
    """Flag every module whose name ends with one of the suffixes; returns (found, missing)."""
    named = list(model.named_modules())
    found: dict[int, torch.nn.Module] = {}
    missing = []
    for suffix in module_name_suffixes:
        hits = [m for n, m in named if n.endswith(suffix)]
        if not hits:
            missing.append(suffix)
        for m in hits:
            partitioned.set_leaf_module(m, flag)
            found.setdefault(id(m), m)
    if missing and raise_if_not_found:
        raise ValueError(f"No modules matching suffixes {missing} found in {type(model).__name__}")
    return list(found.values()), missing


def apply_leaf_config(model: torch.nn.Module, cfg) -> list[torch.nn.Module]:
    """The ``zero_optimization.leaf_module`` config: flag what its classes, names and suffixes
    match (a name or suffix the user gave that matches nothing is a warning, as in DeepSpeed)."""
    found = {id(m): m for m in set_z3_leaf_modules(model, cfg.classes, raise_if_not_found=False)}
    by_name, missing = set_z3_leaf_modules_by_name(model, cfg.names, raise_if_not_found=False)
    by_suffix, unmatched = set_z3_leaf_modules_by_suffix(
        model, cfg.name_suffixes, raise_if_not_found=False
    )
    if missing:
        log.warning("zero_optimization.leaf_module.names: no module named %s", missing)
    if unmatched:
        log.warning("zero_optimization.leaf_module.name_suffixes: nothing ends with %s", unmatched)
    for m in [*by_name, *by_suffix]:
        found.setdefault(id(m), m)
    return list(found.values())
