"""``scheduler`` section: DeepSpeed's warmup schedules, each with its own typed params.

Defaults are DeepSpeed's (deepspeed.runtime.lr_schedules). Learning-rate bounds may be one
number or one per optimizer param group, as there.
"""

from __future__ import annotations

import difflib
import math
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from ..errors import json_repr
from ..fields import Float, Int, Section, rule_error

WarmupType = Literal["log", "linear"]


def _to_lr(value: Any) -> float | list[float]:
    def one(v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"expected a number or a list of numbers, got {json_repr(value)}")
        if not math.isfinite(v):
            raise ValueError(f"learning rates must be finite, got {v}")
        if v < 0:
            raise ValueError(f"learning rates must be >= 0, got {json_repr(value)}")
        return float(v)

    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError("expected a number or a non-empty list of numbers, got []")
        return [one(v) for v in value]
    return one(value)


# One value for every param group, or a list with one value per group.
Lr = Annotated[float | list[float], BeforeValidator(_to_lr)]


class WarmupLRParams(Section):
    """Warm up from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps``, then hold.
    ``warmup_max_lr`` null means each param group's own lr (DeepSpeed's default)."""

    warmup_min_lr: Lr = Field(
        0.0,
        description="The learning rate at the first step: one number, or one per param group.",
    )
    warmup_max_lr: Lr | None = Field(
        None,
        description="The learning rate warmup ends at: one number, or one per param group. "
        "Null: each group's own lr.",
    )
    warmup_num_steps: Int = Field(
        1000,
        gt=0,
        description="Optimizer steps the warmup takes (steps).",
    )
    warmup_type: WarmupType = Field(
        "log",
        description='How the rate rises during warmup: "log" (logarithmically) or "linear".',
    )
    last_batch_iteration: Int = Field(
        -1,
        ge=-1,
        description="The step the schedule resumes after (steps); -1: start from the beginning.",
    )


class WarmupDecayLRParams(WarmupLRParams):
    """WarmupLR, then linear decay to 0 at ``total_num_steps``."""

    total_num_steps: Int = Field(
        gt=0,
        description="The optimizer step at which the rate reaches 0 (steps). Required.",
    )
    warmup_max_lr: Lr = Field(
        0.001,
        description="The learning rate warmup ends at and decay starts from: one number, or "
        "one per param group.",
    )


class WarmupCosineLRParams(Section):
    """Ratios of the optimizer's lr: warm up from ``warmup_min_ratio`` to 1, then cosine decay to
    ``cos_min_ratio`` at ``total_num_steps``."""

    total_num_steps: Int = Field(
        gt=0,
        description="The optimizer step at which the cosine decay ends (steps). Required.",
    )
    warmup_min_ratio: Float = Field(
        0.0,
        ge=0.0,
        description="The learning rate at the first step, as a fraction of the optimizer's lr.",
    )
    warmup_num_steps: Int = Field(
        1000,
        gt=0,
        description="Optimizer steps the warmup takes (steps).",
    )
    cos_min_ratio: Float = Field(
        0.0001,
        ge=0.0,
        description="The learning rate at total_num_steps, as a fraction of the optimizer's lr.",
    )
    warmup_type: WarmupType = Field(
        "log",
        description='How the rate rises during warmup: "log" (logarithmically) or "linear".',
    )
    last_batch_iteration: Int = Field(
        -1,
        ge=-1,
        description="The step the schedule resumes after (steps); -1: start from the beginning.",
    )


class SchedulerConfig(Section):
    """Common shape of ``{"type": ..., "params": {...}}``; the concrete classes below fix
    ``type`` and the params model."""

    type: str = Field(description="The schedule's name, matched case-insensitively.")
    params: Section = Field(description="The schedule's parameters.")


class WarmupLRConfig(SchedulerConfig):
    type: Literal["WarmupLR"] = Field(description="Warm up, then hold the rate.")
    params: WarmupLRParams = Field(
        default_factory=WarmupLRParams, description="WarmupLR's parameters."
    )


class WarmupDecayLRConfig(SchedulerConfig):
    type: Literal["WarmupDecayLR"] = Field(
        description="Warm up, then decay linearly to 0 at total_num_steps."
    )
    params: WarmupDecayLRParams = Field(
        description="WarmupDecayLR's parameters (total_num_steps required)."
    )


class WarmupCosineLRConfig(SchedulerConfig):
    type: Literal["WarmupCosineLR"] = Field(
        description="Warm up, then cosine decay to cos_min_ratio of the lr at total_num_steps."
    )
    params: WarmupCosineLRParams = Field(
        description="WarmupCosineLR's parameters (total_num_steps required)."
    )


SCHEDULER_CONFIGS: dict[str, type[SchedulerConfig]] = {
    "WarmupLR": WarmupLRConfig,
    "WarmupDecayLR": WarmupDecayLRConfig,
    "WarmupCosineLR": WarmupCosineLRConfig,
}
# DeepSpeed schedules this project does not build; named apart so the error says so.
UNBUILT_SCHEDULERS = ("LRRangeTest", "OneCycle")

AnySchedulerConfig = Annotated[
    WarmupLRConfig | WarmupDecayLRConfig | WarmupCosineLRConfig, Field(discriminator="type")
]


def canonical_scheduler_type(value: Any) -> str | None:
    if not isinstance(value, str):
        return None
    return {name.lower(): name for name in SCHEDULER_CONFIGS}.get(value.lower())


def normalize_scheduler(raw: Any) -> Any:
    """Canonical ``type`` (matched case-insensitively) and ``params`` defaulted to ``{}``, or a
    rule error naming ``scheduler.type``. Runs before the discriminated union picks a class."""
    if not isinstance(raw, dict):
        return raw
    if "type" not in raw:
        raise rule_error("type", f"required; one of {', '.join(SCHEDULER_CONFIGS)}")
    name = canonical_scheduler_type(raw["type"])
    if name is None:
        given = raw["type"]
        supported = ", ".join(SCHEDULER_CONFIGS)
        if isinstance(given, str) and given.lower() in {s.lower() for s in UNBUILT_SCHEDULERS}:
            message = f"{json_repr(given)} is not built; supported types: {supported}"
        else:
            close = difflib.get_close_matches(str(given), list(SCHEDULER_CONFIGS), n=1)
            guess = f'; did you mean "{close[0]}"?' if close else ""
            message = f"{json_repr(given)} is not supported; supported types: {supported}{guess}"
        raise rule_error("type", message)
    return {**raw, "type": name, "params": raw.get("params", {})}
