"""Checkpoints that never lose work: atomic save, exact resume, elastic resume into any world
size, stage and placement, and consolidated export. On-disk layout: docs/checkpoints.md."""

from .export.consolidate import (
    convert_zero_checkpoint_to_fp32_state_dict,
    export_safetensors,
    get_fp32_state_dict_from_zero_checkpoint,
)
from .format import CheckpointError, CheckpointNotFoundError, TagMismatchError
from .read.load import load_checkpoint
from .write.save import save_16bit_model, save_checkpoint

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "TagMismatchError",
    "convert_zero_checkpoint_to_fp32_state_dict",
    "export_safetensors",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_checkpoint",
    "save_16bit_model",
    "save_checkpoint",
]
