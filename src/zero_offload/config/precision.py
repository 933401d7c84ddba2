"""``fp16`` and ``bf16`` sections, with DeepSpeed's keys and defaults."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from .fields import Bool, Float, Int, Section


class FP16Config(Section):
    """fp16 mixed precision. ``loss_scale`` 0 means dynamic loss scaling starting at
    ``2**initial_scale_power``; any other value is a static scale."""

    NOT_IMPLEMENTED: ClassVar[frozenset[str]] = frozenset(
        {"fused_mode", "fp16_master_weights_and_grads"}
    )

    enabled: Bool = False
    auto_cast: Bool = False
    # 2**64 bounds every scale: larger ones overflow even fp32 losses (and 2**1024 a float).
    loss_scale: Float = Field(0.0, ge=0, le=2.0**64)
    initial_scale_power: Int = Field(16, ge=0, le=64)
    loss_scale_window: Int = Field(1000, ge=1)
    hysteresis: Int = Field(2, ge=1)
    consecutive_hysteresis: Bool = False
    min_loss_scale: Float = Field(1.0, gt=0, le=2.0**64)

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.loss_scale == 0.0

    @property
    def initial_dynamic_scale(self) -> float:
        return float(2**self.initial_scale_power)


class BF16Config(Section):
    """bf16 mixed precision (no loss scaling: bf16 has fp32's exponent range). The key is
    ``bf16``; DeepSpeed's older ``bfloat16`` is read as the same section."""

    NOT_IMPLEMENTED: ClassVar[frozenset[str]] = frozenset(
        {
            "immediate_grad_update",
            "check_grad_overflow",
            "bf16_master_weights_and_grads",
            "bf16_optimizer_states",
        }
    )

    enabled: Bool = False
