"""``optimizer`` section: Adam and AdamW only, the optimizers ZeRO-Offload's host kernel runs."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from .errors import json_repr
from .fields import Bool, Float, Section

SUPPORTED_OPTIMIZERS = ("Adam", "AdamW")

Beta = Annotated[Float, Field(ge=0.0, lt=1.0)]


class AdamParams(Section):
    """``optimizer.params``. DeepSpeed's ``adam_w_mode`` defaults to true, so ``"type": "Adam"``
    is decoupled weight decay (AdamW) unless ``adam_w_mode`` is false. ``torch_adam`` only picks
    an implementation in DeepSpeed; here it is accepted and changes nothing."""

    NOT_IMPLEMENTED: ClassVar[frozenset[str]] = frozenset(
        {"set_grad_none", "fp32_optimizer_states"}
    )
    KEY_HINTS: ClassVar[dict[str, str]] = {
        "max_grad_norm": 'not an optimizer parameter; use the top-level "gradient_clipping"',
    }

    lr: Float = Field(
        1e-3,
        ge=0.0,
        le=1e3,  # beyond 1e3 no optimizer trains: a typo
        description="The learning rate of every param group that does not set its own (a "
        "scheduler then drives it).",
    )
    betas: tuple[Beta, Beta] = Field(
        (0.9, 0.999),
        description="Adam's decay rates of the first and second moment estimates, each in [0, 1).",
    )
    eps: Float = Field(
        1e-8,
        ge=0.0,
        description="Added to the square root of the second moment in the denominator, for "
        "numerical stability.",
    )
    weight_decay: Float = Field(
        0.0,
        ge=0.0,
        description="Weight decay coefficient: decoupled (AdamW) or added to the gradient "
        "(Adam with adam_w_mode false).",
    )
    bias_correction: Bool = Field(
        True,
        description="Correct the moment estimates for their zero initialization (Adam's "
        "1 - beta**step factors).",
    )
    adam_w_mode: Bool = Field(
        True,
        description='Decoupled weight decay (AdamW) even for "type": "Adam", DeepSpeed\'s '
        "default; false: L2 regularization added to the gradient.",
    )
    torch_adam: Bool = Field(
        False,
        description="DeepSpeed: use torch's Adam implementation instead of its fused one. "
        "Picks no implementation here: the same update either way.",
    )
    amsgrad: Bool = Field(
        False,
        description="AMSGrad's max of past second moments. Not built: true is an error.",
    )

    @field_validator("amsgrad")
    @classmethod
    def _no_amsgrad(cls, value: bool) -> bool:
        if value:
            raise ValueError("amsgrad is not supported; the Adam kernels implement Adam/AdamW only")
        return value


def canonical_optimizer_type(value: Any) -> str | None:
    """DeepSpeed matches optimizer names case-insensitively; None when not Adam/AdamW."""
    if not isinstance(value, str):
        return None
    return {name.lower(): name for name in SUPPORTED_OPTIMIZERS}.get(value.lower())


class OptimizerConfig(Section):
    """``{"type": "Adam" | "AdamW", "params": {...}}``."""

    NOT_IMPLEMENTED: ClassVar[frozenset[str]] = frozenset({"legacy_fusion"})

    type: Literal["Adam", "AdamW"] = Field(
        description='"Adam" or "AdamW", matched case-insensitively, the optimizers the host '
        "kernel runs. Required.",
    )
    params: AdamParams = Field(
        default_factory=AdamParams,
        description="The optimizer's hyperparameters.",
    )

    @model_validator(mode="before")
    @classmethod
    def _drop_foreign_params(cls, data: Any) -> Any:
        # Params of an unsupported optimizer (Lamb's, SGD's) are not Adam's: report the type
        # alone rather than every one of its keys as unknown.
        if isinstance(data, dict) and canonical_optimizer_type(data.get("type")) is None:
            return {k: v for k, v in data.items() if k != "params"}
        return data

    @field_validator("type", mode="before")
    @classmethod
    def _canonical_type(cls, value: Any) -> str:
        name = canonical_optimizer_type(value)
        if name is None:
            supported = ", ".join(SUPPORTED_OPTIMIZERS)
            raise ValueError(
                f"optimizer {json_repr(value)} is not supported; supported types: {supported}"
            )
        return name

    @classmethod
    def nested_section(cls, key: str, raw: dict[str, Any]) -> type[Section] | None:
        if key == "params" and canonical_optimizer_type(raw.get("type")) is None:
            return None
        return super().nested_section(key, raw)

    @property
    def adamw(self) -> bool:
        """Decoupled weight decay, as DeepSpeed decides it: type AdamW, or adam_w_mode."""
        return self.type == "AdamW" or self.params.adam_w_mode
