"""``optimizer.params`` of ``"type": "Muon"``: DeepSpeed's keys, split as its engine splits them
between the Muon group (params with ``use_muon`` true) and the AdamW aux group (the rest)."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field

from ..fields import Bool, Float, Section

Beta = Annotated[Float, Field(ge=0.0, lt=1.0)]
Rate = Annotated[Float, Field(ge=0.0, le=1e3)]  # beyond 1e3 no optimizer trains: a typo

MUON_LR, ADAM_LR = 0.02, 3e-4  # DeepSpeed's MuonWithAuxAdam defaults of each group's lr


class MuonParams(Section):
    """Muon's hyperparameters. ``lr`` is both groups' rate unless ``muon_lr`` / ``adam_lr``
    overrides it for one; unset, each group takes DeepSpeed's default (0.02 for Muon, 3e-4 for
    the aux AdamW). ``momentum`` and ``ns_method`` go to the Muon group only, ``betas`` and
    ``eps`` to the aux group only, ``weight_decay`` (decoupled) to both."""

    PICKED_BY: ClassVar[str] = '"type": "Muon"'
    # DeepSpeed hands it to the aux group's CPU Adam (fp32 moments by default, as here)
    NOT_IMPLEMENTED: ClassVar[frozenset[str]] = frozenset({"fp32_optimizer_states"})

    lr: Rate | None = Field(
        None,
        description="The learning rate of both groups unless muon_lr / adam_lr sets one; null: "
        "0.02 for the Muon group, 3e-4 for the aux AdamW group.",
    )
    muon_lr: Rate | None = Field(
        None, description="The Muon group's learning rate, overriding lr for it."
    )
    adam_lr: Rate | None = Field(
        None, description="The aux AdamW group's learning rate, overriding lr for it."
    )
    momentum: Beta = Field(
        0.95,
        description="Muon's momentum coefficient (Nesterov look-ahead), in [0, 1).",
    )
    ns_method: Literal["gram", "standard"] = Field(
        "gram",
        description='The Newton-Schulz orthogonalization: "gram" (iterates on the Gram matrix, '
        'fewer FLOPs for rectangular matrices) or "standard" (the quintic on the matrix). Five '
        "steps, in fp32.",
    )
    weight_decay: Float = Field(
        0.0, ge=0.0, description="Decoupled weight decay coefficient of both groups."
    )
    betas: tuple[Beta, Beta] = Field(
        (0.9, 0.95),
        description="The aux AdamW group's decay rates of the first and second moments.",
    )
    eps: Float = Field(
        1e-10, ge=0.0, description="The aux AdamW group's denominator term (after sqrt)."
    )

    adam_w_mode: Bool = Field(
        True,
        description="The aux group's weight decay: decoupled (AdamW), DeepSpeed's default; "
        "false: L2 regularization added to its gradient (Adam). The Muon group's decay is "
        "decoupled either way.",
    )
    torch_adam: Bool = Field(
        False,
        description="DeepSpeed: run the aux group with torch's Adam implementation. Picks no "
        "implementation here: the same update either way.",
    )
    foreach: Bool | None = Field(
        None,
        description="DeepSpeed: torch's foreach switch for the aux group under torch_adam. Picks "
        "no implementation here: the same update either way.",
    )

    def muon_group(self) -> dict:
        """The Muon group's hyperparameters (beside ``params``)."""
        lr = self.muon_lr if self.muon_lr is not None else self.lr
        return {
            "lr": MUON_LR if lr is None else lr,
            "momentum": self.momentum,
            "weight_decay": self.weight_decay,
            "ns_method": self.ns_method,
            "use_muon": True,
        }

    def aux_group(self) -> dict:
        """The aux AdamW group's hyperparameters (bias-corrected, as DeepSpeed's adam_update)."""
        lr = self.adam_lr if self.adam_lr is not None else self.lr
        return {
            "lr": ADAM_LR if lr is None else lr,
            "betas": tuple(self.betas),
            "eps": self.eps,
            "weight_decay": self.weight_decay,
            "bias_correction": True,
            "use_muon": False,
        }
