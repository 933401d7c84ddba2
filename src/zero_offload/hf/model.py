"""Loading a local Hugging Face causal LM and giving it the main job's forward contract."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F

from .deps import require_transformers


class CausalLMLoss(torch.nn.Module):
    """``forward(input_ids, labels) -> mean cross-entropy``, the contract of the main job's
    models. ``labels`` are already shifted (``labels[t] == input_ids[t + 1]``, as
    TokenBlockDataset makes them), so the loss is computed here from the logits rather than by
    the model's own ``labels=`` path, which would shift a second time."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=input_ids, use_cache=False).logits
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1))


def load_causal_lm(path: str | os.PathLike[str]) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_pretrained(path)`` from a local folder only (config.json and
    weights, as ``save_pretrained`` writes them), in fp32: the engine casts params to the
    training dtype and keeps buffers in theirs."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"--model {path}: not a Hugging Face model folder (no config.json); give the folder "
            "save_pretrained wrote"
        )
    transformers = require_transformers()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(folder), local_files_only=True, dtype=torch.float32
        )
    except (OSError, ValueError) as exc:
        raise ValueError(f"--model {path}: cannot load a causal LM: {exc}") from None
    model.config.use_cache = False
    return model
