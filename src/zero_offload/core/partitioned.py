"""Is this param partitioned, and where is its shard: the one question every folder asks.

A stage-3 param is partitioned in one of two forms, each recorded by a private tag on the param
that only this module reads or writes:

- **init form** (``zero.Init``, or a model an engine released): the param carries its split
  (``InitShard``: numel, shape, world, this rank's ``lo``/``hi``) and this rank's chunk as
  ``ds_tensor``; ``init_shard(p)`` answers the split.
- **store form** (a live stage-3 engine): the param's values live in a ``ParamStore``'s param
  shard; ``store_of(p)`` and ``slot_of(p)`` answer the store and the slot the param is gathered
  with.

A param is in at most one form at a time (the store takes the init form over, and gives it back
when its engine is destroyed). A param an engine trains also carries its ``EngineLink`` (engine,
optimizer group, index in the group), in either stage. On modules: the ZeRO-3 leaf flag (its name,
``_z3_leaf``, is DeepSpeed's own: code that sets it by hand keeps working) and the params a
module's forward reads though another module owns them (``register_external_parameter``).

DeepSpeed's public param attributes (``ds_id``, ``ds_status``, ``ds_numel``, ``ds_shape``,
``ds_tensor``, ``ds_persist``, ``ds_z3_leaf_module``) are not tags: users and Hugging Face code read
them on the param directly.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

_INIT = "_z3_init"  # the InitShard of an init-form param
_SLOT = "_z3_slot"  # store form: the slot index in the store
_STORE = "_z3_store"  # store form: a weak reference to the ParamStore
_ENGINE = "_zero_offload"  # an EngineLink
_LEAF = "_z3_leaf"  # on a module: fetched whole (DeepSpeed's name)
_EXTERNAL = "_z3_external"  # in a module's __dict__: params its forward reads, owned elsewhere


class EngineLink(NamedTuple):
    """A trained param's place in its engine: ``engine()`` is the engine (None once it is gone),
    ``group`` the optimizer group's index, ``index`` the param's index in that group."""

    ref: weakref.ref
    group: int
    index: int

    def engine(self) -> Any:
        return self.ref()


# ---- the question ------------------------------------------------------------------------------
def is_partitioned(p: torch.Tensor) -> bool:
    """Whether ``p`` is partitioned by this library (init form or store form)."""
    return hasattr(p, _INIT) or hasattr(p, _SLOT)


def shape_of(p: torch.Tensor) -> tuple[int, ...]:
    """A param's shape; a partitioned (stage-3 or zero.Init) param's is its ``ds_shape``."""
    return tuple(getattr(p, "ds_shape", p.shape))


def init_shard(p: torch.Tensor) -> Any:
    """The split of an init-form param (``InitShard``), or None for any other tensor."""
    return getattr(p, _INIT, None)


def slot_of(p: object) -> int | None:
    """The store slot a store-form param is gathered with, or None."""
    return getattr(p, _SLOT, None)


def store_of(p: torch.Tensor) -> Any:
    """The live ``ParamStore`` holding a store-form param's shard, or None."""
    ref = getattr(p, _STORE, None)
    return ref() if ref is not None else None


def engine_link(p: torch.Tensor) -> EngineLink | None:
    """The param's ``EngineLink`` while an engine (live or not yet destroyed) trains it."""
    return getattr(p, _ENGINE, None)


# ---- the owners' writes ------------------------------------------------------------------------
def set_init_shard(p: torch.Tensor, spec: object) -> None:
    """``p`` is now in init form with split ``spec`` (its ``ds_tensor`` is set by the caller)."""
    setattr(p, _INIT, spec)


def clear_init_shard(p: torch.Tensor) -> None:
    """``p`` leaves the init form (whole again, or taken over by a store)."""
    if hasattr(p, _INIT):
        delattr(p, _INIT)


def attach_store(p: torch.Tensor, store: object) -> None:
    """``p``'s shard now lives in ``store`` (held weakly: the param never keeps a store alive)."""
    setattr(p, _STORE, weakref.ref(store))


def set_slot(p: torch.Tensor, index: int) -> None:
    """``p`` is gathered with slot ``index`` of its store."""
    setattr(p, _SLOT, index)


def detach_store(p: torch.Tensor) -> None:
    """``p`` leaves the store form."""
    for attr in (_SLOT, _STORE):
        if hasattr(p, attr):
            delattr(p, attr)


def link_engine(p: torch.Tensor, engine: object, group: int, index: int) -> None:
    """``engine`` trains ``p`` as param ``index`` of optimizer group ``group``."""
    setattr(p, _ENGINE, EngineLink(weakref.ref(engine), group, index))


def unlink_engine(p: torch.Tensor) -> None:
    """The engine that trained ``p`` is destroyed."""
    if hasattr(p, _ENGINE):
        delattr(p, _ENGINE)


# ---- modules -----------------------------------------------------------------------------------
def is_leaf_module(m: torch.nn.Module) -> bool:
    """Whether ``m`` is a ZeRO-3 leaf: fetched whole, with its entire subtree."""
    return bool(getattr(m, _LEAF, False))


def set_leaf_module(m: torch.nn.Module, flag: bool) -> None:
    setattr(m, _LEAF, flag)


def external_params(m: torch.nn.Module) -> Sequence[torch.nn.Parameter]:
    """The params ``m``'s forward reads though another module owns them."""
    return m.__dict__.get(_EXTERNAL, ())


def add_external_param(m: torch.nn.Module, p: torch.nn.Parameter) -> None:
    """Record that ``m``'s forward reads ``p`` (once)."""
    ext = m.__dict__.setdefault(_EXTERNAL, [])
    if all(q is not p for q in ext):
        ext.append(p)
