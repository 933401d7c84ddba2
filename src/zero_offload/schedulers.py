"""DeepSpeed's warmup learning-rate schedules: WarmupLR, WarmupDecayLR, WarmupCosineLR.

Same parameters, defaults and formulas as ``deepspeed.runtime.lr_schedules``, so a DeepSpeed
config trains with the same learning rate at every step. A schedule writes
``optimizer.param_groups[i]["lr"]`` on construction (unless resuming, i.e.
``last_batch_iteration`` != -1) and on every ``step()``; ``step()`` is called once per
optimizer step, after it. ``last_batch_iteration`` counts steps taken, from -1 before the first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from zero_offload.config.optim.scheduler import SchedulerConfig

WARMUP_TYPES = ("log", "linear")


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    # DeepSpeed also accepts a wrapper that holds the torch optimizer as ``.optimizer``.
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    raise TypeError(f"{type(optimizer).__name__} is not a torch.optim.Optimizer")


def _per_group(optimizer: torch.optim.Optimizer, value: Any, name: str) -> list[float]:
    groups = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise ValueError(
                f"{name}: expected {groups} values (one per param group), got {len(value)}"
            )
        return [float(v) for v in value]
    return [float(value)] * groups


def _check_warmup(warmup_num_steps: Any, warmup_type: str) -> None:
    if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int):
        raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps!r}")
    if warmup_num_steps <= 0:
        raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps}")
    if warmup_type not in WARMUP_TYPES:
        raise ValueError(f"warmup_type must be one of {WARMUP_TYPES}, got {warmup_type!r}")


def _group_lr(group: dict[str, Any]) -> float:
    lr = group["lr"]
    return float(lr.item()) if isinstance(lr, torch.Tensor) else float(lr)


class _Schedule:
    """Shared stepping and state; subclasses define ``get_lr()`` from ``last_batch_iteration``."""

    def __init__(self, optimizer: Any, last_batch_iteration: int) -> None:
        self.optimizer = _torch_optimizer(optimizer)
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[float] | None = None

    def _start(self) -> None:
        # A fresh schedule puts its step -1 value in the optimizer at once, as DeepSpeed's do,
        # so the first optimizer step already runs at the warmup's starting lr.
        if self.last_batch_iteration == -1:
            self._apply(self.get_lr())

    def get_lr(self) -> list[float]:
        raise NotImplementedError

    def _apply(self, lrs: Sequence[float]) -> None:
        for group, lr in zip(self.optimizer.param_groups, lrs):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)  # keep a tensor lr a tensor (capturable optimizers)
            else:
                group["lr"] = lr
        self._last_lr = [_group_lr(g) for g in self.optimizer.param_groups]

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance one step (or jump to ``last_batch_iteration``) and set the optimizer's lr."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._apply(self.get_lr())

    def get_last_lr(self) -> list[float]:
        """The lr per param group that the last construction or ``step()`` set."""
        if self._last_lr is None:
            raise RuntimeError("no learning rate set yet: call step() first")
        return list(self._last_lr)

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``; the optimizer's lr changes at the next ``step()``, as in DeepSpeed."""
        self.last_batch_iteration = state["last_batch_iteration"]


class WarmupLR(_Schedule):
    """From ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps`` steps (at least 2),
    then constant. ``warmup_type`` "log": gamma = ln(t + 1) / ln(N); "linear": gamma = t / N;
    lr = min + (max - min) * gamma. ``warmup_max_lr`` None takes each group's lr at construction."""

    def __init__(
        self,
        optimizer: Any,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        _check_warmup(warmup_num_steps, warmup_type)
        super().__init__(optimizer, last_batch_iteration)
        if warmup_max_lr is None:
            warmup_max_lr = [_group_lr(g) for g in self.optimizer.param_groups]
        self.min_lrs = _per_group(self.optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(self.optimizer, warmup_max_lr, "warmup_max_lr")
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs)]
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self._start()

    def _warmup_gamma(self) -> float:
        if self.warmup_type == "log":
            return self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
        return self.last_batch_iteration / self.warmup_num_steps

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_gamma()
        return 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay: gamma = max(0, (T - t) / max(1, T - N)) for t >= N, with
    T = ``total_num_steps``. DeepSpeed's default ``warmup_max_lr`` here is 0.001."""

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(
            optimizer,
            warmup_min_lr,
            warmup_max_lr,
            warmup_num_steps,
            warmup_type,
            last_batch_iteration,
        )

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_gamma()
        remaining = float(self.total_num_steps - self.last_batch_iteration)
        return max(0.0, remaining / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(_Schedule):
    """A ratio of each group's lr at construction: warmup from ``warmup_min_ratio`` to 1 over
    ``warmup_num_steps`` (log or linear, as WarmupLR), then
    ratio = c + (1 - c) * (1 + cos(pi * min(1, (t - N + 1) / max(1, T - N)))) / 2 with
    c = ``cos_min_ratio``, never below 0. Before the first step the lr is 0."""

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        _check_warmup(warmup_num_steps, warmup_type)
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = warmup_type
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.org_lrs = [_group_lr(g) for g in self.optimizer.param_groups]
        self._start()

    def get_lr_ratio(self) -> float:
        t = self.last_batch_iteration
        if t < 0:
            return 0.0
        if t < self.warmup_num_steps:
            if self.warmup_type == "log":
                ratio = self.inverse_log_warm_up * math.log(t + 1)
            else:
                ratio = t / self.warmup_num_steps
            return self.warmup_min_ratio + ratio * (1.0 - self.warmup_min_ratio)
        decay_step = t - self.warmup_num_steps + 1
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        # Clamped so the ratio stays at cos_min_ratio past the end instead of rising again.
        progress = min(1.0, decay_step / decay_steps)
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


SCHEDULERS: dict[str, type[_Schedule]] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
}


def build_lr_scheduler(
    sched_cfg: SchedulerConfig | None, optimizer: torch.optim.Optimizer
) -> WarmupLR | WarmupCosineLR | None:
    """The schedule a validated ``scheduler`` section describes, bound to ``optimizer`` (which
    it immediately sets to the starting lr), or None when the config has no scheduler."""
    if sched_cfg is None:
        return None
    cls = SCHEDULERS.get(sched_cfg.type)
    if cls is None:
        raise ValueError(f"scheduler.type {sched_cfg.type!r} is not one of {list(SCHEDULERS)}")
    return cls(optimizer, **sched_cfg.params.model_dump())  # type: ignore[return-value]
