"""The optimizer object users and LR schedulers see.

A ``torch.optim.Optimizer`` whose ``param_groups`` are the flat groups' hyperparameter dicts (the
same dict objects), so a scheduler writing ``group["lr"]`` changes what the next update uses. The
update itself is the engine's business: ``step()`` here is refused, as calling it outside the
engine would skip gradient reduction.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch

from ....core.flat_group import FlatGroup
from ...update.shard_optimizer import ShardOptimizer


class OptimizerOwner(Protocol):
    """What the optimizer asks of the engine it belongs to (held weakly: the engine holds the
    optimizer)."""

    fetch_schedule: Any  # stage 3: the FetchSchedule; None below
    scales_loss: bool

    def last_step_overflowed(self) -> bool: ...
    def offload_states(self, include, device, pin_memory: bool, non_blocking: bool) -> None: ...
    def reload_states(self, non_blocking: bool) -> None: ...


class ZeroOptimizer(torch.optim.Optimizer):
    def __init__(self, groups: list[FlatGroup], shards: list[ShardOptimizer]) -> None:
        defaults = {k: v for k, v in groups[0].hyper.items() if k != "params"}
        super().__init__(
            [
                {**{k: v for k, v in g.hyper.items() if k != "params"}, "params": g.params}
                for g in groups
            ],
            defaults,
        )
        # torch copied the dicts; point param_groups at the live hyper dicts instead.
        for g, pg in zip(groups, self.param_groups):
            g.hyper.update(pg)
            g.hyper["params"] = g.params
        self.param_groups = [g.hyper for g in groups]
        self.flat_groups = groups
        self.shards = shards
        self._engine: weakref.ref | None = None  # set by ``attach``

    def attach(self, engine: OptimizerOwner) -> None:
        """The engine this optimizer belongs to (held weakly: the engine holds the optimizer)."""
        self._engine = weakref.ref(engine)

    def _owner(self) -> OptimizerOwner | None:
        return self._engine() if self._engine is not None else None

    @property
    def overflow(self) -> bool:
        """DeepSpeed's ``optimizer.overflow``: the latest ``engine.step()`` was an accumulation
        boundary whose update was skipped (inf/NaN gradients). accelerate reads it as
        ``step_was_skipped`` (the Trainer then leaves its LR scheduler alone)."""
        engine = self._owner()
        return bool(engine is not None and engine.last_step_overflowed())

    def needs_scaler(self) -> bool:
        """DeepSpeed's ``optimizer.needs_scaler()``: whether a plain ``loss.backward()`` must be
        given a scaled loss (``engine.scale(loss)``): true with fp16, whose loss scale the
        engine refuses to skip; false with bf16 or fp32."""
        engine = self._owner()
        return bool(engine is not None and engine.scales_loss)

    @property
    def parameter_offload(self):
        """DeepSpeed's ``optimizer.parameter_offload`` of a stage-3 engine, for TRL's generation
        unwrap: the module hooks and the recorded fetch order (``zero.parameter_offload``).
        Below stage 3 absent (an AttributeError), as on DeepSpeed's stage-1/2 optimizer."""
        engine = self._owner()
        schedule = getattr(engine, "fetch_schedule", None)
        if schedule is None:
            raise AttributeError("parameter_offload: the engine is not at ZeRO stage 3")
        from ....zero.parameter_offload import parameter_offload_of

        return parameter_offload_of(schedule)

    # DeepSpeed's stage-3 optimizer also answers these itself (TRL uses it when it lacks
    # parameter_offload): each is parameter_offload's.
    module = property(lambda self: self.parameter_offload.module)
    param_coordinator = property(lambda self: self.parameter_offload.param_coordinator)
    forward_hooks = property(
        lambda self: self.parameter_offload.forward_hooks,
        lambda self, v: setattr(self.parameter_offload, "forward_hooks", v),
    )
    backward_hooks = property(
        lambda self: self.parameter_offload.backward_hooks,
        lambda self, v: setattr(self.parameter_offload, "backward_hooks", v),
    )

    def offload_states(
        self, include=None, device="cpu", pin_memory: bool = True, non_blocking: bool = False
    ) -> None:
        """DeepSpeed's ZeRO optimizers have it too (RLHF trainers call it on
        ``engine.optimizer``): the engine's ``offload_states``."""
        self._live_engine("offload_states").offload_states(
            include, device, pin_memory, non_blocking
        )

    def reload_states(self, non_blocking: bool = False) -> None:
        """The engine's ``reload_states``."""
        self._live_engine("reload_states").reload_states(non_blocking)

    def _live_engine(self, call: str):
        engine = self._owner()
        if engine is None:
            raise RuntimeError(f"optimizer.{call}(): the engine this optimizer belongs to is gone")
        return engine

    def _register_deepspeed_module(self, module) -> None:
        self.parameter_offload._register_deepspeed_module(module)

    def __getattr__(self, name: str):
        """A DeepSpeed ZeRO optimizer attribute this one lacks (``parameter_offload``,
        ``module``, ...: DeepSpeed internals some libraries reach for) fails by its DeepSpeed
        name; still an AttributeError, so ``hasattr`` answers False."""
        if name.startswith("_"):
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        from ...._as_deepspeed import DeepSpeedNotProvidedError

        raise DeepSpeedNotProvidedError(
            f"engine.optimizer.{name}", " (DeepSpeed's ZeRO optimizer internals)"
        )

    def step(self, closure=None):  # noqa: D401
        raise RuntimeError(
            "call engine.step(), not optimizer.step(): the engine reduces gradients first"
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients live in engine-owned buffers; the engine clears them after each step."""
