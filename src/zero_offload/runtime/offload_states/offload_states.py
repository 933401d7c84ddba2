"""DeepSpeed's ``engine.offload_states()`` / ``engine.reload_states()``: free the training
engine's device memory while another engine (a generation server in RLHF) uses the accelerator,
then put everything back so training goes on bit for bit as if nothing happened.

Each named state (``state_buffers``: each optimizer group's own buffers, ``OptimizerGroup
.state_buffers``, and what no group owns: the frozen param shards, the reduce buffers) is moved
storage by storage (``storage_move.py``); ``MovedStates`` holds what moved and is the one check
every engine call makes (a no-op while nothing is moved). The
bytes go to host memory (pinned with CUDA when ``pin_memory``), the device storage shrinks to
zero, every view of it (params, ``p.grad``, the update's operands) stays in place and reads the
same bits after reload. What DeepSpeed does, and so does this engine:

- stages 1, 2 and 3 with an optimizer; ``offload_param`` and "nvme" as the target are refused
  (assertion / ``ValueError``), device "none" warns and does nothing;
- a state already in host memory (``offload_optimizer``) has no device buffer: a no-op;
- offloading a state twice, or reloading with nothing offloaded, does nothing;
- stage 3 first releases every gathered param (``empty_partition_cache``); the next forward
  gathers them again;
- nothing is reloaded implicitly: ``forward`` (needs ``lp_params``), ``backward`` (also the
  gradients and reduce buffers), ``step``, ``zero_grad`` and checkpoint calls while a state they
  need is offloaded raise ``EngineUsageError`` naming it, never compute on missing values.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from enum import Enum

import torch

from ...config.zero import OFFLOAD_DEVICES, OffloadDeviceEnum
from .. import errors as guards
from ..update.buffers import OffloadStateType, StateBuffer
from .param_rebind import ParamRebind
from .storage_move import StorageMover, check_movable

log = logging.getLogger("zero_offload")

_ALL = tuple(OffloadStateType)
# What each of the engine's calls reads, beyond what it checks itself.
FORWARD_NEEDS = frozenset({OffloadStateType.lp_params})
BACKWARD_NEEDS = frozenset(
    {
        OffloadStateType.lp_params,
        OffloadStateType.lp_grads,
        OffloadStateType.contiguous_grad_buffer,
    }
)
GRADS_NEED = frozenset({OffloadStateType.lp_grads})
MASTER_NEEDED = frozenset({OffloadStateType.hp_params})
EVERYTHING = frozenset(_ALL)


def parse_include(include) -> tuple[OffloadStateType, ...]:
    """``include``: None (every state), one state, or a collection of states (enum members or
    their names)."""
    if include is None:
        return _ALL
    if isinstance(include, str | OffloadStateType):
        include = [include]
    allowed = ", ".join(s.value for s in _ALL)
    try:
        items = list(include)
    except TypeError:
        raise ValueError(
            f"offload_states(include=...): expected None or a collection of "
            f"OffloadStateTypeEnum ({allowed}), got {type(include).__name__}"
        ) from None
    out = []
    for item in items:
        value = item.value if isinstance(item, Enum) else item
        if value not in {s.value for s in _ALL}:
            raise ValueError(
                f"offload_states(include=...): unknown state {item!r}; allowed: {allowed}"
            )
        out.append(OffloadStateType(value))
    return tuple(dict.fromkeys(out))


def parse_device(device) -> str:
    value = device.value if isinstance(device, OffloadDeviceEnum) else device
    if value not in OFFLOAD_DEVICES:
        allowed = ", ".join(OFFLOAD_DEVICES)
        raise ValueError(f"offload_states(device=...): allowed {allowed}; got {device!r}")
    return value


class MovedStates:
    """The states ``offload_states()`` moved to the host: their storages and the module's params
    pointed at the host copies meanwhile. Empty unless something is offloaded; the engine calls
    ``require`` before every call that reads a state, unconditionally."""

    def __init__(self, delayed: bool) -> None:
        self.mover = StorageMover()
        self.rebound = ParamRebind()
        # a pending delayed update's upload writes the params: flushing it needs them
        self._flush_needs = FORWARD_NEEDS if delayed else frozenset()

    def require(self, call: str, needs: frozenset) -> None:
        """Raise if a state ``call`` (as the message names it: "engine.forward()") reads is
        offloaded."""
        if not self.mover:
            return
        missing = needs & self.mover.owners()
        if missing:
            names = ", ".join(sorted(s.value for s in missing))
            raise guards.EngineUsageError(
                f"{call}: {names} offloaded by engine.offload_states(); call "
                "engine.reload_states() first"
            )

    def require_flush(self, call: str) -> None:
        self.require(call, self._flush_needs)

    def reload(self, non_blocking: bool = False) -> None:
        """Every moved storage back, the params bound to it again (nothing moved: a no-op)."""
        self.mover.reload(non_blocking)
        self.rebound.restore()

    def report(self, out: dict[str, int]) -> None:
        """``memory_report``'s entries with what moved counted in host memory, as much as its
        host copies reserve (pinned: more), instead of on the device."""
        held = self.mover.held_bytes()
        for k, v in self.mover.moved_bytes().items():
            out[k] = out.get(k, 0) - v
            host = "host." + k.split(".", 1)[1]
            out[host] = out.get(host, 0) + held[k]


def state_buffers(e, state: OffloadStateType) -> list[StateBuffer]:
    """The engine's device buffers of ``state``: each optimizer group's own, then what no group
    owns (the frozen params' shards at stage 3, the reducer's pooled reduce buffers)."""
    out = [b for og in e.opt_groups for b in og.state_buffers(state)]
    return out + list(_engine_buffers(e, state))


def _engine_buffers(e, state: OffloadStateType) -> Iterator[StateBuffer]:
    store = e.param_store
    if state is OffloadStateType.lp_params and store is not None:
        for gi in range(len(e.opt_groups), len(store.groups)):
            t = store.shards[gi]
            if t is not None and t.device == e.device:  # not a host (offload_param) shard
                yield StateBuffer(t, "device.frozen_param_shard")
    if state is OffloadStateType.contiguous_grad_buffer:
        for base in e.reducer.bufs.pool.bases:
            yield StateBuffer(base, None, keep=False)


class OffloadStatesAPI:
    """Mixed into ZeroOffloadEngine; ``moved`` holds what is offloaded."""

    moved: MovedStates

    def offload_states(
        self,
        include: Iterable[OffloadStateType] | None = None,
        device: OffloadDeviceEnum | str = OffloadDeviceEnum.cpu,
        pin_memory: bool = True,
        non_blocking: bool = False,
    ) -> None:
        """Move the named states (default: all) to host memory (DeepSpeed's signature)."""
        guards.check_alive(self.destroyed, "offload_states")
        states = parse_include(include)
        where = parse_device(device)
        self._check_offloadable()
        if where == "none":
            log.warning("offload_states(device='none'): no device to offload to; nothing moved")
            return
        if where == "nvme":
            raise ValueError("NVMe offload is not supported for offloading states.")
        plan = [(state, buf) for state in states for buf in state_buffers(self, state)]
        for state, buf in plan:  # every refusal before anything moves
            where = f" ({buf.category})" if buf.category else ""
            check_movable(buf.tensor, f"offload_states(): {state.value}{where}")
        cuda = self.device.type == "cuda"
        if cuda:  # reductions, host copies and gathers queued on side streams read these
            torch.cuda.synchronize(self.device)
        if self.param_store is not None:
            self.param_store.empty_cache()
        pin = bool(pin_memory) and cuda
        for state, buf in plan:
            owners = {state, *buf.also}
            self.moved.mover.offload(buf.tensor, owners, buf.category, pin, non_blocking, buf.keep)
        self.moved.rebound.rebind(self.module.parameters(), self.moved.mover)
        if self.param_store is not None:
            self.moved.rebound.rebind_list(self.param_store.shards, self.moved.mover)
        if cuda:
            if not non_blocking:
                torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # the freed memory goes back to the driver (other engines)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Every offloaded state back where it was, with the same bits (DeepSpeed's)."""
        guards.check_alive(self.destroyed, "reload_states")
        self._check_offloadable()
        self.moved.reload(non_blocking)
        if self.device.type == "cuda" and non_blocking:
            torch.cuda.synchronize(self.device)  # as DeepSpeed: the states are usable on return

    def offloaded_states(self) -> set[OffloadStateType]:
        """The states whose device memory is in host memory now (a state sharing its storage
        with another, the fp32 master that is the params, counts as both)."""
        return self.moved.mover.owners()

    def require_loaded(self, call: str) -> None:
        """Raise unless every state is on the device (for callers outside the engine that read
        the shards: the tensor-fragment accessors)."""
        self.moved.require(f"{call}()", EVERYTHING)

    def _check_offloadable(self) -> None:
        """DeepSpeed's refusals: parameter offload, no optimizer; and stage 0, whose optimizer
        has no ``offload_states`` in DeepSpeed."""
        if self.placement.params != "device":
            raise guards.EngineAssertionError(
                "Moving states across devices is not supported for offloaded parameters "
                '(zero_optimization.offload_param.device is not "none").'
            )
        if not self.opt_groups or self.optimizer is None:
            raise guards.EngineAssertionError(
                "Moving states across devices is not supported without an optimizer."
            )
        if self.stage == 0:
            raise guards.EngineUsageError(
                "offload_states/reload_states need zero_optimization.stage 1, 2 or 3 (DeepSpeed's "
                "ZeRO optimizers provide them; stage 0 has none)"
            )
