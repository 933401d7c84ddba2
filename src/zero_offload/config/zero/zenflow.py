"""``zero_optimization.zenflow``: DeepSpeed's ZenFlow (stall-free offload), its keys, defaults
and refusals as DeepSpeed 0.19.8 has them, and the schedule its "auto" values resolve to.

ZenFlow updates the most important gradient columns of each 2-D param (and every 1-D param) on
the device at every step, and the rest on the host every ``update_interval`` steps from the
gradients accumulated meanwhile. ``runtime/update/zenflow/`` builds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from ..errors import json_repr
from ..fields import Bool, Float, Section, rule_error


def _interval(value: Any, key: str, least: int) -> Any:
    """DeepSpeed's ``Union[str, int]``: "auto" or an integer (``update_interval`` >= 1)."""
    if isinstance(value, str):
        if value != "auto":
            raise rule_error(key, f'if a string, it must be "auto" (got {json_repr(value)})')
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise rule_error(key, f'must be "auto" or an integer (got {json_repr(value)})')
    if value < least:
        raise rule_error(key, f"if a number, it must be at least {least} (got {value})")
    return value


class ZenFlowConfig(Section):
    """DeepSpeed's ``ZenFlowConfig``: every key, with its meaning and default."""

    AUTO_IS_A_VALUE: ClassVar[frozenset[str]] = frozenset(
        {"select_strategy", "select_interval", "update_interval"}
    )

    topk_ratio: Float = Field(
        0.1,
        gt=0.0,
        lt=1.0,
        description="Share of each 2-D param's gradient columns (ranked by the L1 norm of the "
        "column's gradient) updated on the device every step; 0 < ratio < 1.",
    )
    select_strategy: Literal["auto", "step", "epoch"] = Field(
        "auto",
        description='When the columns are chosen again: "step" (every select_interval steps), '
        '"epoch" (every select_interval epochs of the training dataloader; without one: once) '
        'or "auto" ("epoch" with select_interval 1).',
    )
    select_interval: int | str = Field(
        "auto",
        description='Steps (or epochs) between two selections; "auto" only with '
        'select_strategy "auto". At least update_interval.',
    )
    update_interval: int | str = Field(
        "auto",
        description="Steps between two host updates of the unselected columns (their "
        'gradients accumulate meanwhile; it becomes gradient_accumulation_steps). "auto": '
        "decided at run time from the gradients, DeepSpeed's rule (auto_ratio; the loss is not "
        "divided).",
    )
    overlap_step: Bool = Field(
        False,
        description="Run the host update in the background during the next update_interval "
        "steps' forward and backward (its result lands one interval late; two alternating sets "
        "of host moments, as DeepSpeed).",
    )
    offload: Bool = Field(
        False,
        description="Keep the selected columns' Adam moments in host memory between steps "
        "(needs overlap_comm).",
    )
    auto_ratio: Float = Field(
        0.99,
        ge=0.0,
        le=1.0,
        description='update_interval "auto": the share of 2-D params whose unselected '
        "gradient has caught up with the selected one that ends an interval.",
    )
    full_warm_up_rounds: int = Field(
        0,
        ge=0,
        description="First steps that update every element on the host, with no selection.",
    )
    pt_reserved_cores_perc: Float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="Share of this rank's cores kept for the training thread; the rest run the "
        "overlapped host update (overlap_step).",
    )
    steps_per_epoch: int | None = Field(
        None,
        description="Set at run time from the training dataloader's length; not a user key.",
    )

    @model_validator(mode="before")
    @classmethod
    def _intervals(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, least in (("select_interval", 0), ("update_interval", 1)):
                if key in data:
                    _interval(data[key], key, least)
            wr = data.get("full_warm_up_rounds", 0)
            if isinstance(wr, bool) or not isinstance(wr, int):
                raise rule_error("full_warm_up_rounds", f"must be an integer (got {json_repr(wr)})")
        return data


@dataclass(frozen=True)
class ZenFlowSchedule:
    """The resolved schedule, as DeepSpeed's engine resolves it (``configure_zenflow``).

    ``select_interval`` 0: select once (at the first step after the warm-up). ``update_interval``
    0 with ``auto_update``: decided at run time. ``update_interval`` is what DeepSpeed sets
    ``gradient_accumulation_steps`` to."""

    topk_ratio: float
    select_interval: int
    update_interval: int
    auto_update: bool
    full_warm_up_rounds: int
    overlap_step: bool
    offload: bool
    auto_ratio: float

    def is_select(self, micro: int) -> bool:
        """Micro-step ``micro`` (0-based) chooses the columns (DeepSpeed's select boundary)."""
        k = micro - self.full_warm_up_rounds
        return k >= 0 and (
            k == 0 or (self.select_interval != 0 and micro % self.select_interval == 0)
        )

    def is_update(self, micro: int) -> bool:
        """Micro-step ``micro`` ends with a host update (DeepSpeed's accumulation boundary), for
        a fixed ``update_interval`` (with "auto" the run-time rule decides:
        ``runtime/update/zenflow/auto_interval.py``)."""
        n, si, warm = micro + 1, self.select_interval, self.full_warm_up_rounds
        assert not self.auto_update
        return n < warm or (n - warm) % self.update_interval == 0 or (si != 0 and n % si == 0)

    @property
    def grad_divisor(self) -> int:
        """What DeepSpeed divides each step's loss by: gradient_accumulation_steps, which it
        sets to update_interval (0 with "auto", a division by 0: here none)."""
        return self.update_interval if self.update_interval > 1 else 1


def resolve_schedule(cfg: ZenFlowConfig, steps_per_epoch: int | None) -> ZenFlowSchedule:
    """DeepSpeed's resolution of the "auto" values; ``steps_per_epoch``: the training
    dataloader's length, if the engine was given one. Refusals name the key."""
    strategy, interval = cfg.select_strategy, cfg.select_interval
    key = "zero_optimization.zenflow.select_interval"
    if strategy == "auto":
        if isinstance(interval, int):
            raise ValueError(
                f'{key}: with select_strategy "auto" the interval is 1 epoch; give "auto" '
                f'(got {interval}), or select_strategy "step" or "epoch"'
            )
        strategy, interval = "epoch", 1
    elif isinstance(interval, str):
        raise ValueError(f"{key}: must be a number with select_strategy {json_repr(strategy)}")
    auto_update = isinstance(cfg.update_interval, str)
    update = 0 if auto_update else int(cfg.update_interval)
    if strategy == "epoch":
        interval = interval * steps_per_epoch if steps_per_epoch is not None else 0
    if not auto_update and interval != 0 and interval < update:
        raise ValueError(
            f"{key}: must be at least zero_optimization.zenflow.update_interval ({interval} < "
            f"{update} steps)"
        )
    return ZenFlowSchedule(
        topk_ratio=cfg.topk_ratio,
        select_interval=interval,
        update_interval=update,
        auto_update=auto_update,
        full_warm_up_rounds=cfg.full_warm_up_rounds,
        overlap_step=cfg.overlap_step,
        offload=cfg.offload,
        auto_ratio=cfg.auto_ratio,
    )


def check_zenflow(zero: Any) -> None:
    """The rules ZenFlow puts on the rest of ``zero_optimization`` (DeepSpeed's refusals)."""
    zf = zero.zenflow
    if zf is None:
        return
    oc = zero.offload_optimizer
    device = "none" if oc is None else oc.device
    if device != "cpu":
        raise rule_error(
            "zenflow", f'needs offload_optimizer.device "cpu" (got {json_repr(device)})'
        )
    if zero.stage not in (1, 2, 3):
        raise rule_error("zenflow", f"needs stage 1, 2 or 3 (stage is {zero.stage})")
    if not getattr(zero, "compute_grad_norm", True):
        raise rule_error("compute_grad_norm", "false does not support ZenFlow")
    if oc.delayed_update:  # this project's key; ZenFlow's overlap_step is its delayed update
        raise rule_error(
            "zenflow",
            "cannot combine with offload_optimizer.delayed_update (both decide when the host "
            "update lands); remove delayed_update and use zenflow.overlap_step",
        )
    if oc.ratio < 1.0:  # DeepSpeed's partial offload asserts its own host Adam, not ZenFlow's
        raise rule_error(
            "zenflow",
            f"needs offload_optimizer.ratio 1.0 (got {oc.ratio}); DeepSpeed 0.19.8 "
            "refuses a partial offload with ZenFlow",
        )
    if zf.offload and not zero.overlap_comm:
        raise rule_error("zenflow.offload", "true needs overlap_comm true")
