"""DeepSpeed's tensor-fragment API (``deepspeed.utils.tensor_fragment``): read and write one
parameter's fp32 master weight, optimizer state (Adam's ``"exp_avg"``, ``"exp_avg_sq"``; a client
optimizer's state tensors by their keys) and gradient, whole (``safe_*_full_*``) or as this rank's
piece (``safe_*_local_*``, ZeRO stage 3 only), at every stage and placement.

Where the values live (core/layout.py): a trainable param sits in one bucket of its flat group,
and rank r owns the r-th slice of every bucket (stage 0: all of it). The rank's fp32 master shard
and Adam state (the shard optimizer's ``master``, ``exp_avg``, ``exp_avg_sq``: on the device, or
in host memory with ``offload_optimizer``) and its reduced gradient (grad_shard.py, scaled by the
fp16 loss scale) are laid out in those shard coordinates. The 16-bit params are views of the flat
buffer (stages 0-2) or the param store's shards (stage 3, on the host with ``offload_param``).

Collectives: every rank calls every function here, for the same params in the same order.
- The full getters and ``safe_update_full_grad_vectorized`` all-gather (stages 1-3).
- The setters communicate nothing themselves, but each rank writes only its own slice, so every
  rank must pass the same full value (local setters: each its own piece); at stage 3 they also
  drop or refresh gathered copies, whose next gather must happen on every rank.
- With ``offload_optimizer.delayed_update`` any pending host update is applied first (stages 1-2:
  an all-gather), so a read sees it and a write lands on top of it.

Gradients: the averaged, unscaled, unclipped gradient of the accumulation window, between the
backward that ends the window and ``step()``; the grad setters raise outside that interval. A
written gradient also updates the squared norm that step() clips by and checks for overflow.

As DeepSpeed: a frozen param (``requires_grad=False``, owned by no optimizer group) gives None and
its setters do nothing; the local functions raise an ``AssertionError`` (here also a
``ValueError``) naming the function for a param that is not ZeRO-3 partitioned. Differences:
a trainable param that no live engine manages (its engine destroyed, another model's, or at
stages 0-2 left out of ``model_parameters``) raises ``ValueError`` where DeepSpeed returns None
or skips it (or, for ``safe_get_full_grad``, returns ``param.grad``); the
fp32 setters also write the 16-bit param the model computes with (DeepSpeed's take effect at the
next step's fp32-to-16-bit copy); the local getters return copies, on the engine's device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from ..core import dist, partitioned
from ..core.status import ZeroParamStatus


class Zero3OnlyError(AssertionError, ValueError):
    """A local (``safe_*_local_*``) function got a param that is not ZeRO-3 partitioned
    (DeepSpeed asserts; this is both an AssertionError and a ValueError)."""


@dataclass(frozen=True)
class _Where:
    """A managed param and its place: flat range [off, off + numel) in bucket ``bucket`` of group
    ``gi``; this rank's piece of it is flat [lo, hi) (empty when hi <= lo), inside the rank's
    segment ``seg`` of that bucket."""

    engine: object
    gi: int
    i: int
    param: torch.Tensor
    off: int
    numel: int
    shape: torch.Size
    bucket: object
    seg: object
    lo: int
    hi: int

    @property
    def local_numel(self) -> int:
        return max(self.hi - self.lo, 0)

    def in_seg(self) -> slice:
        """This rank's piece, as offsets inside its segment."""
        a = self.lo - self.seg.flat_start
        return slice(a, a + self.local_numel)

    def in_value(self) -> slice:
        """This rank's piece, as offsets inside the flat param value."""
        return slice(self.lo - self.off, self.lo - self.off + self.local_numel)

    def in_shard(self) -> slice:
        a = self.seg.shard_start + self.lo - self.seg.flat_start
        return slice(a, a + self.local_numel)

    def in_bucket(self) -> slice:
        return slice(self.off - self.bucket.start, self.off - self.bucket.start + self.numel)


def _locate(engine, gi: int, i: int, param: torch.Tensor) -> _Where:
    g = engine.opt_groups[gi].flat
    off, n = g.layout.offsets[i], g.layout.numels[i]
    b = next(b for b in g.layout.buckets if b.start <= off < b.start + b.numel)
    s = g.segments(engine.stage >= 1)[b.index]
    lo, hi = max(off, s.flat_start), min(off + n, s.flat_start + s.numel)
    shape = torch.Size(getattr(param, "ds_shape", param.shape))
    return _Where(engine, gi, i, param, off, n, shape, b, s, lo, hi)


def _unmanaged(fn: str) -> ValueError:
    return ValueError(
        f"{fn}: the parameter is trainable but not managed by a live zero_offload engine (its "
        "engine was destroyed, it belongs to another model, it was left out of the engine's "
        "model_parameters, or the engine has no optimizer)"
    )


def _zero3_only(fn: str) -> Zero3OnlyError:
    return Zero3OnlyError(
        f"{fn} is only defined for ZeRO-3 partitioned parameters (zero_optimization.stage 3); "
        f"use the safe_*_full_* functions at stages 0-2"
    )


def _lookup(param: torch.Tensor, fn: str, local: bool = False) -> _Where | None:
    """The managed param's place; None for a param no optimizer group owns (frozen)."""
    link = partitioned.engine_link(param)
    engine = link.engine() if link is not None else None
    if engine is not None:
        if local and engine.stage != 3:
            raise _zero3_only(fn)
        engine.require_loaded(fn)  # offload_states(): the shards are empty until reload
        return _locate(engine, link.group, link.index, param)
    store = partitioned.store_of(param)
    if store is not None and not store.slots[partitioned.slot_of(param)].trainable:
        return None  # a live stage-3 engine's param that no optimizer group owns
    if local and not hasattr(param, "ds_id"):  # DeepSpeed asserts this before anything else
        raise _zero3_only(fn)
    if not param.requires_grad:
        return None
    raise _unmanaged(fn)


def _settle(engine, writing: bool) -> None:
    """Apply a pending delayed update; before a write also let every async copy that reads the
    shards finish (uploads from the host master, gathers from the param shard)."""
    engine.flush_delayed_update()
    if writing:
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
        if engine.param_store is not None:
            engine.param_store.quiesce()


def _seg_views(engine, gi: int, what: str, key: str = "", fn: str = "") -> list[torch.Tensor]:
    """This rank's pieces of group ``gi``'s ``what`` ("fp32", "grad", or "state" ``key``), one
    per segment (``OptimizerGroup.fragment``)."""
    return engine.opt_groups[gi].fragment(what, key, fn)


def _gather_bucket(w: _Where, views: list[torch.Tensor]) -> torch.Tensor:
    """The whole bucket holding ``w``'s param, fp32 on the engine's device (a collective at
    stages 1-3; stage 0 ranks hold all of it)."""
    g = w.engine.opt_groups[w.gi].flat
    piece = views[w.bucket.index].to(device=g.device, dtype=torch.float32)
    out = torch.empty(w.bucket.numel, dtype=torch.float32, device=g.device)
    if w.engine.stage == 0:
        out.copy_(piece)
    else:
        dist.all_gather(out, piece)
    return out


def _full(w: _Where, views: list[torch.Tensor], scale: float = 1.0) -> torch.Tensor:
    value = _gather_bucket(w, views)[w.in_bucket()].view(w.shape).clone()
    return value.div_(scale) if scale != 1.0 else value


def _local(w: _Where, views: list[torch.Tensor], scale: float = 1.0) -> torch.Tensor:
    g = w.engine.opt_groups[w.gi].flat
    piece = views[w.bucket.index][w.in_seg()]
    value = piece.to(device=g.device, dtype=torch.float32, copy=True)
    return value.div_(scale) if scale != 1.0 else value


def _flat(fn: str, value: torch.Tensor, numel: int, what: str) -> torch.Tensor:
    value = torch.as_tensor(value)
    if value.numel() != numel:
        raise ValueError(f"{fn}: value has {value.numel()} elements, the {what} has {numel}")
    return value.detach().reshape(-1)


def _write_piece(w: _Where, views: list[torch.Tensor], piece: torch.Tensor, scale=1.0) -> None:
    if w.local_numel:
        dst = views[w.bucket.index][w.in_seg()]
        dst.copy_(piece * scale if scale != 1.0 else piece)


def _write_16bit(w: _Where, flat: torch.Tensor | None, piece: torch.Tensor) -> None:
    """The 16-bit param the model computes with takes the new value: stages 0-2 the whole param
    in the flat buffer (every rank has the full value); stage 3 this rank's param shard, plus
    the gathered copy if the param is gathered (refreshed from ``flat``, or dropped and, when
    ``GatheredParameters`` pins it or it is persistent, gathered again: a collective)."""
    e = w.engine
    if e.param_store is None:
        e.opt_groups[w.gi].flat.flat[w.off : w.off + w.numel].copy_(flat)
        return
    store = e.param_store
    if w.local_numel:
        store.shard_write(w.gi, w.in_shard().start, piece)
    i = partitioned.slot_of(w.param)
    if store.slots[i].status is not ZeroParamStatus.AVAILABLE:
        return
    if flat is not None:
        store.slots[i].buf[w.in_bucket()].copy_(flat)
        return
    keep = store.pinned[i] > 0 or store.slots[i].persistent
    store.release(i, force=True)
    if keep:
        store.fetch([i])


def _check_grad_window(engine, fn: str) -> None:
    if not engine.window.ended:
        raise RuntimeError(
            f"{fn}: gradients can be written only after the backward that ends the gradient "
            "accumulation window and before step()"
        )


def _refresh_norm(engine, gi: int) -> None:
    """The group's squared gradient norm (this rank's part) from its gradient as it is now."""
    engine.opt_groups[gi].refresh_grad_norm(engine.device)


# ---- full views ------------------------------------------------------------------------------
def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """The param's whole fp32 master weight (shape of the param, on the engine's device), or
    None for a frozen param. Collective (all ranks, same order)."""
    w = _lookup(param, "safe_get_full_fp32_param")
    if w is None:
        return None
    _settle(w.engine, writing=False)
    return _full(w, _seg_views(w.engine, w.gi, "fp32"))


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set the param's fp32 master weight and the 16-bit param the next forward uses to
    ``value`` (its full value, any shape with the param's number of elements). Every rank calls
    it with the same value; a frozen param is left alone."""
    fn = "safe_set_full_fp32_param"
    w = _lookup(param, fn)
    if w is None:
        return
    flat = _flat(fn, value, w.numel, "parameter")
    _settle(w.engine, writing=True)
    piece = flat[w.in_value()]
    with torch.no_grad():
        _write_piece(w, _seg_views(w.engine, w.gi, "fp32"), piece)
        _write_16bit(w, flat, piece)


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """The param's whole fp32 optimizer state ``optim_state_key`` ("exp_avg", "exp_avg_sq"; a
    client optimizer's own keys), or None for a frozen param. Collective (all ranks, same
    order)."""
    fn = "safe_get_full_optimizer_state"
    key = optim_state_key
    w = _lookup(param, fn)
    if w is None:
        return None
    _settle(w.engine, writing=False)
    return _full(w, _seg_views(w.engine, w.gi, "state", key, fn))


def safe_set_full_optimizer_state(
    param: torch.Tensor, value: torch.Tensor, optim_state_key: str
) -> None:
    """Set the param's optimizer state ``optim_state_key`` to ``value`` (full). Every rank calls
    it with the same value; a frozen param is left alone."""
    fn = "safe_set_full_optimizer_state"
    key = optim_state_key
    w = _lookup(param, fn)
    if w is None:
        return
    flat = _flat(fn, value, w.numel, "parameter")
    _settle(w.engine, writing=True)
    with torch.no_grad():
        _write_piece(w, _seg_views(w.engine, w.gi, "state", key, fn), flat[w.in_value()])


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The param's whole gradient (averaged, unscaled, unclipped; fp32), or None for a frozen
    param. Call between the boundary backward and step(). Collective (all ranks, same order)."""
    w = _lookup(param, "safe_get_full_grad")
    if w is None:
        return None
    e = w.engine
    return _full(w, _seg_views(e, w.gi, "grad"), float(e.loss_scale))


def safe_set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set the param's gradient (full, unscaled) for the coming step(); between the boundary
    backward and step(). Every rank calls it with the same value; a frozen param is left
    alone."""
    fn = "safe_set_full_grad"
    w = _lookup(param, fn)
    if w is None:
        return
    flat = _flat(fn, value, w.numel, "parameter")
    _write_grads(fn, w.engine, [(w, flat)])


def _write_grads(fn: str, engine, writes: list[tuple[_Where, torch.Tensor]], local=False) -> None:
    """Write gradient values (full, or with ``local`` this rank's pieces; unscaled) into the
    grad shard, then recompute the squared norms of the groups written."""
    _check_grad_window(engine, fn)
    if engine.device.type == "cuda":  # the reductions' side streams are done writing
        torch.cuda.synchronize(engine.device)
    scale = float(engine.loss_scale)
    with torch.no_grad():
        for w, value in writes:
            piece = value if local else value[w.in_value()]
            _write_piece(w, _seg_views(engine, w.gi, "grad"), piece, scale)
        for gi in dict.fromkeys(w.gi for w, _ in writes):
            _refresh_norm(engine, gi)


def safe_update_full_grad_vectorized(
    param_list: Iterable[torch.Tensor],
    update_func: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> None:
    """Replace the gradient of every param in ``param_list`` by ``update_func(grad, param)``,
    where ``grad`` is its current full gradient (fp32, unscaled, the param's shape) and the
    result its new full gradient; frozen params are skipped. Between the boundary backward and
    step(). One all-gather per bucket holding a listed param, bucket by bucket (not in list
    order). Collective: every rank calls it with the same list, in the same order."""
    fn = "safe_update_full_grad_vectorized"
    found: dict[int, _Where] = {}
    for p in param_list:
        w = _lookup(p, fn)
        if w is not None:
            found.setdefault(id(p), w)
    if not found:
        return
    engines = {id(w.engine): w.engine for w in found.values()}
    for engine in engines.values():
        ws = sorted((w for w in found.values() if w.engine is engine), key=lambda w: (w.gi, w.off))
        _check_grad_window(engine, fn)
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
        scale = float(engine.loss_scale)
        with torch.no_grad():
            for k, w in enumerate(ws):  # one bucket gathered at a time
                views = _seg_views(engine, w.gi, "grad")
                if k == 0 or (ws[k - 1].gi, ws[k - 1].bucket.index) != (w.gi, w.bucket.index):
                    bucket = _gather_bucket(w, views)
                    if scale != 1.0:
                        bucket.div_(scale)
                old = bucket[w.in_bucket()].view(w.shape).clone()
                new = _flat(fn, update_func(old, w.param), w.numel, "parameter")
                _write_piece(w, views, new[w.in_value()], scale)
            for gi in dict.fromkeys(w.gi for w in ws):
                _refresh_norm(engine, gi)


# ---- local pieces (stage 3) ------------------------------------------------------------------
def safe_get_local_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's piece of the param's fp32 master weight (1-D, a copy; may be empty); the
    pieces of ranks 0, 1, ... concatenated are the flat param. None for a frozen param.
    ZeRO stage 3 only."""
    w = _lookup(param, "safe_get_local_fp32_param", local=True)
    if w is None:
        return None
    _settle(w.engine, writing=False)
    return _local(w, _seg_views(w.engine, w.gi, "fp32"))


def safe_set_local_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set this rank's piece of the param (fp32 master and 16-bit shard) to ``value`` (as many
    elements as ``param.ds_tensor``). Every rank calls it, each with its own piece: a gathered
    copy of the param is dropped (under ``GatheredParameters``, gathered again). ZeRO stage 3
    only; a frozen param is left alone."""
    fn = "safe_set_local_fp32_param"
    w = _lookup(param, fn, local=True)
    if w is None:
        return
    piece = _flat(fn, value, w.local_numel, "local partition")
    _settle(w.engine, writing=True)
    with torch.no_grad():
        _write_piece(w, _seg_views(w.engine, w.gi, "fp32"), piece)
        _write_16bit(w, None, piece)


def safe_get_local_optimizer_state(
    param: torch.Tensor, optim_state_key: str
) -> torch.Tensor | None:
    """This rank's piece of the param's optimizer state (1-D, a copy), or None for a frozen
    param. ZeRO stage 3 only."""
    fn = "safe_get_local_optimizer_state"
    key = optim_state_key
    w = _lookup(param, fn, local=True)
    if w is None:
        return None
    _settle(w.engine, writing=False)
    return _local(w, _seg_views(w.engine, w.gi, "state", key, fn))


def safe_set_local_optimizer_state(
    param: torch.Tensor, value: torch.Tensor, optim_state_key: str
) -> None:
    """Set this rank's piece of the param's optimizer state. Every rank calls it. ZeRO stage 3
    only; a frozen param is left alone."""
    fn = "safe_set_local_optimizer_state"
    key = optim_state_key
    w = _lookup(param, fn, local=True)
    if w is None:
        return
    piece = _flat(fn, value, w.local_numel, "local partition")
    _settle(w.engine, writing=True)
    with torch.no_grad():
        _write_piece(w, _seg_views(w.engine, w.gi, "state", key, fn), piece)


def safe_get_local_grad(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's piece of the param's gradient (1-D fp32, unscaled, a copy), or None for a
    frozen param. Between the boundary backward and step(). ZeRO stage 3 only."""
    w = _lookup(param, "safe_get_local_grad", local=True)
    if w is None:
        return None
    e = w.engine
    return _local(w, _seg_views(e, w.gi, "grad"), float(e.loss_scale))


def safe_set_local_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set this rank's piece of the param's gradient (unscaled); between the boundary backward
    and step(). Every rank calls it. ZeRO stage 3 only; a frozen param is left alone."""
    fn = "safe_set_local_grad"
    w = _lookup(param, fn, local=True)
    if w is None:
        return
    piece = _flat(fn, value, w.local_numel, "local partition")
    _write_grads(fn, w.engine, [(w, piece)], local=True)


__all__ = [
    "Zero3OnlyError",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "safe_update_full_grad_vectorized",
]
