"""DeepSpeed's ``deepspeed.utils.zero_to_fp32`` names over this project's checkpoint export.

``get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None,
exclude_frozen_parameters=False)`` and ``convert_zero_checkpoint_to_fp32_state_dict(
checkpoint_dir, output_dir, max_shard_size="5GB", safe_serialization=False, tag=None,
exclude_frozen_parameters=False)`` (DeepSpeed 0.19.8's signature) read this project's
checkpoints (see docs/checkpoints.md); a DeepSpeed checkpoint is first converted with
``zero-offload convert-deepspeed``. ``load_state_dict_from_zero_checkpoint(model,
checkpoint_dir, tag=None)`` loads the fp32 weights into ``model`` (on the CPU, in its own dtype)
and returns it.
"""

from __future__ import annotations

import torch

from ..checkpoint.export.consolidate import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
)

__all__ = [
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
]


def load_state_dict_from_zero_checkpoint(
    model: torch.nn.Module, checkpoint_dir, tag: str | None = None
) -> torch.nn.Module:
    """DeepSpeed's helper: the checkpoint's fp32 weights loaded into ``model``, moved to the CPU
    (strict load: every key must match). The model keeps its dtype, as in DeepSpeed: a bf16
    model gets the fp32 masters rounded, which are its own trained values. At stage 3 call it on
    the engine's module inside ``GatheredParameters(model.parameters())``."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=tag)
    model = model.cpu()
    model.load_state_dict(state, strict=True)
    return model
