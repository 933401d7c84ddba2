"""Which of the engine's device buffers make up each of DeepSpeed's offloadable states.

DeepSpeed's ``OffloadStateTypeEnum`` names five states; here each is a list of the engine's own
device-resident tensors (a state already in host memory or on NVMe has none, so offloading it is
a no-op, as DeepSpeed's exclusions under ``offload_optimizer`` make it). Each optimizer group
lists its own buffers (``OptimizerGroup.buffers``); this file adds what no group owns (the
params, which an fp32 master may be, and the reduce buffers). The five states:

| state | tensors | memory-report entry |
| --- | --- | --- |
| ``optim_states`` | Adam's ``exp_avg``/``exp_avg_sq`` on the device (a partial offload's device part); a client optimizer's state | ``device.optimizer_state`` |
| ``hp_params`` | the fp32 master shard on the device; with fp32 params it *is* the params (``AliasState``), which move with it | ``device.master_shard`` |
| ``lp_params`` | the flat buffers (stages 0-2) or the device param shards, frozen ones too (stage 3) | ``device.params`` / ``device.param_shard`` |
| ``lp_grads`` | the flat grad buffer and fp32 accumulator (stages 0/1), the device grad shard (2/3) | ``device.grads`` / ``grad_accum`` / ``grad_shard`` |
| ``contiguous_grad_buffer`` | the reducer's pooled reduce buffers (scratch: not restored) | (a peak entry only) |
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from ..update.buffers import OffloadStateType, StateBuffer

if TYPE_CHECKING:
    from .engine import ZeroOffloadEngine

__all__ = ["OffloadStateType", "StateBuffer", "state_buffers"]


def state_buffers(e: ZeroOffloadEngine, state: OffloadStateType) -> list[StateBuffer]:
    return list(_BUILDERS[state](e))


def _group_buffers(e: ZeroOffloadEngine, state: OffloadStateType) -> Iterator[StateBuffer]:
    """The groups' own buffers of ``state`` (``OptimizerGroup.buffers``)."""
    for og in e.opt_groups:
        yield from (b for b in og.buffers() if b.state is state)


def _optim_states(e: ZeroOffloadEngine) -> Iterator[StateBuffer]:
    return _group_buffers(e, OffloadStateType.optim_states)


def _hp_params(e: ZeroOffloadEngine) -> Iterator[StateBuffer]:
    for og in e.opt_groups:
        if og.master_is_params:  # the fp32 params are the master: they move as one storage
            t, category = _lp_buffer(e, og.index)
            yield StateBuffer(t, category, also=frozenset({OffloadStateType.lp_params}))
        else:
            yield from (b for b in og.buffers() if b.state is OffloadStateType.hp_params)


def _lp_buffer(e: ZeroOffloadEngine, gi: int) -> tuple[torch.Tensor, str]:
    """Group ``gi``'s 16-bit (or fp32) params on the device: its flat buffer or param shard."""
    store = e.param_store
    if store is None:
        return e.groups[gi].flat, "device.params"
    name = "param_shard" if store.trainable(gi) else "frozen_param_shard"
    return store.shards[gi], f"device.{name}"


def _lp_params(e: ZeroOffloadEngine) -> Iterator[StateBuffer]:
    store = e.param_store
    count = len(e.groups) if store is None else len(store.groups)
    for gi in range(count):
        t, category = _lp_buffer(e, gi)
        if t is not None and t.device == e.device:  # not a host (offload_param) shard
            yield StateBuffer(t, category)


def _lp_grads(e: ZeroOffloadEngine) -> Iterator[StateBuffer]:
    return _group_buffers(e, OffloadStateType.lp_grads)


def _contiguous_grad_buffer(e: ZeroOffloadEngine) -> Iterator[StateBuffer]:
    for base in e.reducer.bufs.pool.bases:
        yield StateBuffer(base, None, keep=False)


_BUILDERS = {
    OffloadStateType.optim_states: _optim_states,
    OffloadStateType.hp_params: _hp_params,
    OffloadStateType.lp_params: _lp_params,
    OffloadStateType.lp_grads: _lp_grads,
    OffloadStateType.contiguous_grad_buffer: _contiguous_grad_buffer,
}
