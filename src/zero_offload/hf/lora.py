"""LoRA adapters via peft: the base weights are frozen, only the adapters train (and only they
take optimizer state and gradient buffers in the engine)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .deps import require_peft


@dataclass(frozen=True)
class LoraSpec:
    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    # None: peft's default modules for the model type (q_proj/v_proj for Llama, c_attn for GPT-2).
    target_modules: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"--lora-r must be a positive integer, got {self.r!r}")
        if not isinstance(self.alpha, (int, float)) or self.alpha <= 0:
            raise ValueError(f"--lora-alpha must be positive, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"--lora-dropout must be in [0, 1), got {self.dropout!r}")


def apply_lora(model: torch.nn.Module, spec: LoraSpec) -> torch.nn.Module:
    """``peft.get_peft_model(model, LoraConfig(...))`` for causal LM fine-tuning."""
    peft = require_peft()
    config = peft.LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=list(spec.target_modules) if spec.target_modules else None,
        task_type="CAUSAL_LM",
    )
    try:
        return peft.get_peft_model(model, config)
    except ValueError as exc:
        raise ValueError(f"--lora: {exc}") from None
