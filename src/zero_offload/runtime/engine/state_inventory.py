"""Which of the engine's device buffers make up each of DeepSpeed's offloadable states.

DeepSpeed's ``OffloadStateTypeEnum`` names five states; here each is a list of the engine's own
device-resident tensors (a state already in host memory or on NVMe has none, so offloading it is
a no-op, as DeepSpeed's exclusions under ``offload_optimizer`` make it):

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
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

import torch

from ...core.twin_state import TwinState

if TYPE_CHECKING:
    from .engine import ZeroOffloadEngine


class OffloadStateType(str, Enum):
    """DeepSpeed's ``OffloadStateTypeEnum``."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


@dataclass(frozen=True)
class StateBuffer:
    tensor: torch.Tensor
    category: str | None  # the memory-report entry it is counted under (None: not counted)
    keep: bool = True  # False: scratch, reloaded with undefined contents
    also: frozenset = frozenset()  # other states that live in the same storage


def state_buffers(e: ZeroOffloadEngine, state: OffloadStateType) -> list[StateBuffer]:
    return list(_BUILDERS[state](e))


def _device_parts(state) -> list:
    """The device-resident parts of a group's shard state (a twin's device part)."""
    if isinstance(state, TwinState):
        return [state.device]
    return [state] if getattr(state, "where", None) == "device" else []


def _optim_states(e: ZeroOffloadEngine) -> Iterator[StateBuffer]:
    for og in e.opt_groups:
        parts = _device_parts(og.optimizer.state)
        for part in parts:
            for t in (part.exp_avg, part.exp_avg_sq):
                if t is not None:  # Muon's momentum state has no second moment
                    yield StateBuffer(t, "device.optimizer_state")
        client = og.optimizer.client
        if client is not None and parts:  # it runs where the master lives: on the device
            for v in client.optimizer.state[client.param].values():
                if isinstance(v, torch.Tensor) and v.device == client.param.device:
                    yield StateBuffer(v, None)
            yield StateBuffer(client.grad, None, keep=False)  # rewritten before every step


def _hp_params(e: ZeroOffloadEngine) -> Iterator[StateBuffer]:
    for og in e.opt_groups:
        for part in _device_parts(og.optimizer.state):
            if getattr(part, "aliased", False):  # the fp32 params are the master
                t, category = _lp_buffer(e, og.index)
                yield StateBuffer(t, category, also=frozenset({OffloadStateType.lp_params}))
            else:
                yield StateBuffer(part.master, "device.master_shard")


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
    for gs in e.grad_shards:
        named = (
            (gs.flat_grad, "device.grads"),
            (gs.accum, "device.grad_accum"),
            (gs.device_shard, "device.grad_shard"),
        )
        for t, category in named:
            if t is not None:
                yield StateBuffer(t, category)


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
