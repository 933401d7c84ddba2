"""``fp16`` and ``bf16`` sections, with DeepSpeed's keys, defaults and checks.

As in DeepSpeed (``deepspeed/runtime/precision_config.py``), a number may be given as a numeric
string (pydantic's lax mode; ``loss_scale`` as Python's ``float()`` reads it, and
``loss_scale_window`` and ``min_loss_scale`` only in ``int()`` form), and the checks on the
loss-scaling keys apply only where the key acts: a disabled ``fp16`` block (or a static
``loss_scale``) may carry any values for the dynamic-scaling keys, as DeepSpeed's configs and
Hugging Face's templates do.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, ClassVar

from pydantic import Field, ValidationInfo, field_validator

from ..fields import (
    Bool,
    DsInt,
    Section,
    pydantic_int,
    reads_numeric_strings,
    to_float,
    to_int,
)

# 2**64 bounds every scale: larger ones overflow even fp32 losses (and 2**1024 a float).
MAX_SCALE = 2.0**64
MAX_SCALE_POWER = 64


def _int_form(text: str) -> int:
    # DeepSpeed's _reject_non_integer_scale_params: int(v) must succeed (so "8.0" and "1e3" do
    # not), then pydantic's int field converts the string.
    int(text)
    return pydantic_int(text)


# fp16.loss_scale: DeepSpeed's _validate_loss_scale reads it with float().
LossScale = Annotated[float, reads_numeric_strings(float, to_float)]
# fp16.loss_scale_window: an int field behind DeepSpeed's int() check.
WindowInt = Annotated[int, reads_numeric_strings(_int_form, to_int)]
# fp16.min_loss_scale: the same reading of a string (a number may be fractional here).
MinScale = Annotated[float, reads_numeric_strings(_int_form, to_float)]


class FP16Config(Section):
    """fp16 mixed precision. ``loss_scale`` 0 means dynamic loss scaling starting at
    ``2**initial_scale_power``; any other value is a static scale."""

    NOT_IMPLEMENTED: ClassVar[frozenset[str]] = frozenset(
        {"fused_mode", "fp16_master_weights_and_grads"}
    )

    enabled: Bool = Field(
        False,
        description="Train in fp16: 16-bit params and gradients, fp32 master weights and "
        "optimizer state, the loss scaled.",
    )
    auto_cast: Bool = Field(
        False,
        description="DeepSpeed: cast the forward's floating inputs to fp16. The engine here "
        "passes inputs as given: cast them yourself.",
    )
    # >= 0 and finite always (DeepSpeed's check); at most MAX_SCALE when enabled.
    loss_scale: LossScale = Field(
        0.0,
        ge=0,
        description="0: dynamic loss scaling; any other value: this static scale (at most "
        "2**64 with fp16 enabled).",
    )
    # The dynamic-scaling keys: checked (in _dynamic_scaling) only with fp16 enabled and
    # loss_scale 0.
    initial_scale_power: DsInt = Field(
        16,
        description="Dynamic scaling starts at 2**initial_scale_power (a power of two, 0-64).",
    )
    loss_scale_window: WindowInt = Field(
        1000,
        description="Dynamic scaling doubles the scale after this many consecutive steps "
        "without overflow (steps, >= 1).",
    )
    hysteresis: DsInt = Field(
        2,
        description="Dynamic scaling halves the scale at this many overflowing steps since the "
        "count was last refilled (steps, >= 1; 1: at every overflow).",
    )
    consecutive_hysteresis: Bool = Field(
        False,
        description="Dynamic scaling: refill the hysteresis after each step without overflow, "
        "so only consecutive overflows lower the scale.",
    )
    min_loss_scale: MinScale = Field(
        1.0,
        description="Dynamic scaling never goes below this scale (> 0, at most 2**64).",
    )

    @field_validator("loss_scale")
    @classmethod
    def _static_scale(cls, value: float, info: ValidationInfo) -> float:
        if info.data.get("enabled") and value > MAX_SCALE:
            raise ValueError(f"must be <= {MAX_SCALE} (got {value!r})")
        return value

    @field_validator("initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale")
    @classmethod
    def _dynamic_scaling(cls, value: Any, info: ValidationInfo) -> Any:
        # DeepSpeed checks these only where dynamic loss scaling runs (fp16 enabled, loss_scale
        # 0); elsewhere nothing reads them. A sibling that failed its own check is absent from
        # info.data: nothing more is reported then.
        if not (info.data.get("enabled") is True and info.data.get("loss_scale") == 0.0):
            return value
        name = info.field_name
        if name == "initial_scale_power" and not 0 <= value <= MAX_SCALE_POWER:
            bound = ">= 0" if value < 0 else f"<= {MAX_SCALE_POWER}"
            raise ValueError(f"must be {bound} (got {value})")
        if name in ("loss_scale_window", "hysteresis") and value < 1:
            raise ValueError(f"must be >= 1 (got {value})")
        if name == "min_loss_scale":
            if value <= 0:
                raise ValueError(f"must be > 0.0 (got {value!r})")
            if value > MAX_SCALE:
                raise ValueError(f"must be <= {MAX_SCALE} (got {value!r})")
        return value

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.loss_scale == 0.0

    @property
    def initial_dynamic_scale(self) -> float:
        # ldexp: a disabled block may hold any power; no huge integer is built for it.
        return math.ldexp(1.0, self.initial_scale_power)


class BF16Config(Section):
    """bf16 mixed precision (no loss scaling: bf16 has fp32's exponent range). The key is
    ``bf16``; DeepSpeed's older ``bfloat16`` is read as the same section."""

    NOT_IMPLEMENTED: ClassVar[frozenset[str]] = frozenset(
        {
            "immediate_grad_update",
            "check_grad_overflow",
        }
    )

    enabled: Bool = Field(
        False,
        description="Train in bf16: 16-bit params and gradients, fp32 master weights and "
        "optimizer state (unless bf16_master_weights_and_grads and bf16_optimizer_states).",
    )
    # The compact states' rules across sections (stage, offload, optimizer type, ZenFlow) are
    # in ``compact_states.py``; ``core/state/format.StateFormat.from_config`` reads these three.
    bf16_master_weights_and_grads: Bool = Field(
        False,
        description="DeepSpeed's: keep the optimizer's master weights and the gradient shards "
        "in bf16 (2 bytes each instead of 4), the master being the bf16 params' own values. "
        "Needs bf16.enabled and ZeRO stage 1-3; without bf16_optimizer_states (fp32 moments) "
        'or an 8-bit-moment optimizer, also offload_optimizer ("cpu" or "nvme").',
    )
    bf16_optimizer_states: Bool = Field(
        False,
        description="DeepSpeed's: keep both Adam moments in bf16 too (with the master and "
        "gradients, 8 bytes of host state per param with offload instead of 16). Needs "
        "bf16_master_weights_and_grads; not with the 8-bit-moment optimizers.",
    )
    stochastic_rounding: Bool = Field(
        False,
        description="This project's extension, off by default (DeepSpeed rounds to nearest): "
        "write the bf16 master with stochastic rounding, so updates smaller than half a bf16 "
        "ulp of a weight are kept on average instead of dropped. Needs "
        "bf16_master_weights_and_grads; seeded by the top-level seed.",
    )
