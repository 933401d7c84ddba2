"""DeepSpeed's ``optimizer.parameter_offload`` (``DeepSpeedZeRoOffload``) as TRL reaches for it:
a thin adapter over the stage-3 fetch schedule.

TRL's ``unwrap_model_for_generation`` (GRPO, online DPO, GKD, RLOO under ZeRO-3) gathers every
param once (``GatheredParameters``), then removes the engine's module hooks so that ``generate``
runs as a plain model, and puts them back afterwards::

    offload = engine.optimizer.parameter_offload          # or the optimizer itself
    for p in params(offload.module) + offload.module.ds_external_parameters():
        p.ds_active_sub_modules.clear()
    for h in offload.forward_hooks + offload.backward_hooks: h.remove()
    offload.forward_hooks = offload.backward_hooks = []
    ... generate ...
    if not offload.param_coordinator.is_invalid_trace():
        offload.param_coordinator._invalidate_trace()
    offload._register_deepspeed_module(offload.module)

Here ``forward_hooks`` are the schedule's module forward pre/post hooks (fetch, release, and the
backward fetch they set up), ``backward_hooks`` its post-accumulate-grad hooks (release once a
slot's gradients are final): the real handles, so removing them really leaves the model
unhooked. ``_register_deepspeed_module(module)`` re-registers both sets on the engine's module.
``param_coordinator`` is the schedule's recorded fetch order: invalidating it makes the next
pass of each kind record its order afresh. ``ds_active_sub_modules`` is an empty set on every
partitioned param (the schedule tracks need per module, not per param) and
``ds_external_parameters()`` lists a module's params declared external
(``register_external_parameter``), as DeepSpeed's do.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch

from ..core import partitioned


class TraceControl:
    """DeepSpeed's ``PartitionedParameterCoordinator`` as far as trace invalidation goes."""

    def __init__(self, schedule) -> None:
        self._schedule = schedule

    def is_invalid_trace(self) -> bool:
        """No fetch order recorded (before the first pass, or since ``_invalidate_trace``)."""
        s = self._schedule
        return not s.traces and s.recording is None

    def _invalidate_trace(self) -> None:
        if self.is_invalid_trace():  # as DeepSpeed's coordinator
            raise RuntimeError("attempted to invalidate already invalid trace")
        self._schedule.invalidate_trace()

    def reset_step(self) -> None:
        """DeepSpeed's per-forward reset: the schedule starts each pass itself."""


class ExternalParameters:
    """``module.ds_external_parameters()``: ``(name, param)`` for each param the module reads
    though another module owns it (``register_external_parameter``). Holds the module weakly;
    a copy of the module (``copy.deepcopy``, pickling) gets one that lists nothing, as a copy
    is not scheduled."""

    def __init__(self, module: torch.nn.Module | None) -> None:
        self._module = weakref.ref(module) if module is not None else None

    def __call__(self) -> list[tuple[int, torch.nn.Parameter]]:
        module = self._module() if self._module is not None else None
        if module is None:
            return []
        return [(id(p), p) for p in _externals(module)]  # DeepSpeed's keys: id(param)

    def __deepcopy__(self, memo) -> ExternalParameters:
        return ExternalParameters(None)

    def __reduce__(self):
        return (ExternalParameters, (None,))


def _externals(module: torch.nn.Module) -> Iterable[torch.nn.Parameter]:
    return partitioned.external_params(module)


class ParameterOffload:
    """``engine.optimizer.parameter_offload`` of a stage-3 engine (see the module docstring)."""

    def __init__(self, schedule) -> None:
        self._schedule = schedule
        self.module: torch.nn.Module = schedule.module
        self.param_coordinator = TraceControl(schedule)
        for m in self.module.modules():
            if "ds_external_parameters" not in m.__dict__:
                m.__dict__["ds_external_parameters"] = ExternalParameters(m)
        for slot in schedule.store.slots:
            for p in slot.params:
                if not hasattr(p, "ds_active_sub_modules"):
                    p.ds_active_sub_modules = set()

    @property
    def forward_hooks(self) -> list:
        return self._schedule.module_handles

    @forward_hooks.setter
    def forward_hooks(self, handles: list) -> None:
        self._schedule.module_handles = list(handles)

    @property
    def backward_hooks(self) -> list:
        return self._schedule.grad_handles

    @backward_hooks.setter
    def backward_hooks(self, handles: list) -> None:
        self._schedule.grad_handles = list(handles)

    def get_param_coordinator(self, training: bool = True) -> TraceControl:
        return self.param_coordinator

    def _register_deepspeed_module(self, module: torch.nn.Module, count=None) -> None:
        """Put the schedule's hooks back on the engine's module (any still present are replaced,
        never doubled) and forget the recorded fetch order, as DeepSpeed does for its root."""
        if module is not self.module:
            raise ValueError(
                "parameter_offload._register_deepspeed_module: zero_offload registers the "
                "stage-3 hooks on the engine's whole module only; pass "
                "parameter_offload.module"
            )
        if not self.param_coordinator.is_invalid_trace():
            self._schedule.invalidate_trace()
        self._schedule.install_hooks()


def parameter_offload_of(schedule) -> ParameterOffload:
    """The one adapter of a fetch schedule (made on first use)."""
    adapter = schedule.parameter_offload
    if adapter is None:
        adapter = ParameterOffload(schedule)
        schedule.parameter_offload = adapter
    return adapter
