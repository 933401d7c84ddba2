"""``optimizer`` section: Adam and AdamW (the optimizers ZeRO-Offload's host kernel runs), their
blockwise 8-bit-moment forms Adam8bit and AdamW8bit (this project's extension: the same update,
both moments kept as uint8 codes with an fp32 scale per ``block_size`` values), and Muon with
its AdamW aux group (``muon_params.py``), at stages 0-3."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from ...kernels.quant_maps import DEFAULT_BLOCK_SIZE, check_block_size
from ..errors import json_repr
from ..fields import Bool, Float, Int, Section
from .muon_params import MuonParams

SUPPORTED_OPTIMIZERS = ("Adam", "AdamW", "Adam8bit", "AdamW8bit", "Muon")
# The types whose two moments are kept 8-bit (``Adam8bitParams``); each is its Adam type's update.
EIGHT_BIT_OPTIMIZERS = ("Adam8bit", "AdamW8bit")

Beta = Annotated[Float, Field(ge=0.0, lt=1.0)]


class AdamParams(Section):
    """``optimizer.params`` of Adam and AdamW. DeepSpeed's ``adam_w_mode`` defaults to true, so ``"type": "Adam"``
    is decoupled weight decay (AdamW) unless ``adam_w_mode`` is false. ``torch_adam`` only picks
    an implementation in DeepSpeed; here it is accepted and changes nothing."""

    PICKED_BY: ClassVar[str] = '"type": "Adam" | "AdamW"'
    NOT_IMPLEMENTED: ClassVar[frozenset[str]] = frozenset(
        {"set_grad_none", "fp32_optimizer_states"}
    )
    KEY_HINTS: ClassVar[dict[str, str]] = {
        "max_grad_norm": 'not an optimizer parameter; use the top-level "gradient_clipping"',
        "block_size": 'a parameter of the 8-bit-moment types only ("type": "Adam8bit" or '
        '"AdamW8bit")',
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


class Adam8bitParams(AdamParams):
    """``optimizer.params`` of Adam8bit and AdamW8bit: Adam's and AdamW's (the same update, the
    same ``adam_w_mode`` rule) plus ``block_size``, the values sharing one fp32 scale of each
    8-bit moment."""

    PICKED_BY: ClassVar[str] = '"type": "Adam8bit" | "AdamW8bit"'
    KEY_HINTS: ClassVar[dict[str, str]] = {
        k: v for k, v in AdamParams.KEY_HINTS.items() if k != "block_size"
    }

    block_size: Int = Field(
        DEFAULT_BLOCK_SIZE,
        description="This project's extension: the values of each 8-bit moment that share one "
        "fp32 scale (their absmax), a power of two from 32 to 256 (the state is 2 + 8 / "
        "block_size bytes per param for both moments).",
    )

    @field_validator("block_size")
    @classmethod
    def _block(cls, value: int) -> int:
        try:
            return check_block_size(value)
        except ValueError as err:  # the loader names the key
            raise ValueError(str(err).removeprefix("block_size ")) from None


class _Adam8bitInput(dict):
    """An Adam8bit/AdamW8bit config's ``params`` on its way to ``Adam8bitParams`` (the
    discriminator's mark, as ``_MuonInput``)."""


class _MuonInput(dict):
    """A Muon config's ``params`` object on its way to ``MuonParams`` (the discriminator's
    mark: the params object itself does not say which optimizer it belongs to)."""


def _params_kind(value: Any) -> str:
    if isinstance(value, _MuonInput | MuonParams):
        return "muon"
    return "adam8bit" if isinstance(value, _Adam8bitInput | Adam8bitParams) else "adam"


def canonical_optimizer_type(value: Any) -> str | None:
    """DeepSpeed matches optimizer names case-insensitively; None when not supported."""
    if not isinstance(value, str):
        return None
    return {name.lower(): name for name in SUPPORTED_OPTIMIZERS}.get(value.lower())


class OptimizerConfig(Section):
    """``{"type": "Adam" | "AdamW" | "Adam8bit" | "AdamW8bit" | "Muon", "params": {...}}``."""

    NOT_IMPLEMENTED: ClassVar[frozenset[str]] = frozenset({"legacy_fusion"})

    type: Literal["Adam", "AdamW", "Adam8bit", "AdamW8bit", "Muon"] = Field(
        description='"Adam" or "AdamW" (the optimizers the host kernel runs); "Adam8bit" or '
        '"AdamW8bit" (this project\'s extension: the same updates with both moments quantized '
        'blockwise to 8 bits, params.block_size values per fp32 scale); or "Muon" (with an '
        "AdamW aux group for the params whose use_muon is false; stages 0-3, its state on the "
        'device or, with offload_optimizer "cpu", on the host), '
        "matched case-insensitively. Required.",
    )
    params: Annotated[
        Annotated[AdamParams, Tag("adam")]
        | Annotated[Adam8bitParams, Tag("adam8bit")]
        | Annotated[MuonParams, Tag("muon")],
        Discriminator(_params_kind),
    ] = Field(
        default_factory=AdamParams,
        description="The optimizer's hyperparameters.",
    )

    @model_validator(mode="before")
    @classmethod
    def _drop_foreign_params(cls, data: Any) -> Any:
        # Params of an unsupported optimizer (Lamb's, SGD's) are not Adam's: report the type
        # alone rather than every one of its keys as unknown.
        if not isinstance(data, dict):
            return data
        kind = canonical_optimizer_type(data.get("type"))
        if kind is None:
            return {k: v for k, v in data.items() if k != "params"}
        # Muon's and the 8-bit types' params (or none: their defaults), marked for the union
        mark = {"Muon": _MuonInput, "Adam8bit": _Adam8bitInput, "AdamW8bit": _Adam8bitInput}
        if kind in mark:
            params = data.get("params", {})
            if isinstance(params, dict):
                return {**data, "params": mark[kind](params)}
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
        if key == "params":
            kind = canonical_optimizer_type(raw.get("type"))
            if kind is None:
                return None
            if kind in EIGHT_BIT_OPTIMIZERS:
                return Adam8bitParams
            return MuonParams if kind == "Muon" else AdamParams
        return super().nested_section(key, raw)

    @property
    def muon(self) -> bool:
        return self.type == "Muon"

    @property
    def eight_bit(self) -> bool:
        """Adam8bit or AdamW8bit: both moments kept blockwise 8-bit."""
        return self.type in EIGHT_BIT_OPTIMIZERS

    @property
    def adamw(self) -> bool:
        """Decoupled weight decay, as DeepSpeed decides it: type AdamW, or adam_w_mode (for
        Muon, of its aux Adam group; the Muon group's decay is always decoupled)."""
        if isinstance(self.params, MuonParams):
            return self.params.adam_w_mode
        return self.type in ("AdamW", "AdamW8bit") or self.params.adam_w_mode
