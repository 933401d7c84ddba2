"""DeepSpeed's ``engine.offload_states()`` / ``engine.reload_states()``: free the training
engine's device memory while another engine (a generation server in RLHF) uses the accelerator,
then put everything back so training goes on bit for bit as if nothing happened.

Each named state (``state_inventory.py``) is moved storage by storage (``storage_move.py``): the
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
from collections.abc import Iterable
from enum import Enum

import torch

from ...config.zero import OFFLOAD_DEVICES, OffloadDeviceEnum
from . import guards
from .param_rebind import ParamRebind
from .state_inventory import OffloadStateType, state_buffers
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


class OffloadStatesAPI:
    """Mixed into ZeroOffloadEngine. ``_offloaded`` (a ``StorageMover``) is empty unless some
    state is offloaded; the hot path tests only its truth value."""

    _offloaded: StorageMover
    _rebound: ParamRebind  # the module's params pointed at the host copies meanwhile

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
            self._offloaded.offload(buf.tensor, owners, buf.category, pin, non_blocking, buf.keep)
        self._rebound.rebind(self.module.parameters(), self._offloaded)
        if self.param_store is not None:
            self._rebound.rebind_list(self.param_store.shards, self._offloaded)
        if cuda:
            if not non_blocking:
                torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # the freed memory goes back to the driver (other engines)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Every offloaded state back where it was, with the same bits (DeepSpeed's)."""
        guards.check_alive(self.destroyed, "reload_states")
        self._check_offloadable()
        self._offloaded.reload(non_blocking)
        self._rebound.restore()
        if self.device.type == "cuda" and non_blocking:
            torch.cuda.synchronize(self.device)  # as DeepSpeed: the states are usable on return

    def offloaded_states(self) -> set[OffloadStateType]:
        """The states whose device memory is in host memory now (a state sharing its storage
        with another, the fp32 master that is the params, counts as both)."""
        return self._offloaded.owners()

    def require_loaded(self, call: str) -> None:
        """Raise unless every state is on the device (for callers outside the engine that read
        the shards: the tensor-fragment accessors)."""
        if self._offloaded:
            self._check_states(f"{call}()", frozenset(OffloadStateType))

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

    def _check_states(self, call: str, needs: frozenset) -> None:
        """Raise if a state ``call`` (as the message names it: "engine.forward()") reads is
        offloaded (the caller tests ``_offloaded`` first)."""
        missing = needs & self._offloaded.owners()
        if missing:
            names = ", ".join(sorted(s.value for s in missing))
            raise guards.EngineUsageError(
                f"{call}: {names} offloaded by engine.offload_states(); call "
                "engine.reload_states() first"
            )
