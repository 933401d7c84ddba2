"""``deepspeed.utils.zero_to_fp32``: ``zero_offload.utils.zero_to_fp32``'s functions (they read
zero_offload checkpoints; a DeepSpeed checkpoint is converted first with
``zero-offload convert-deepspeed``)."""

from ...utils.zero_to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)
from .._common import not_provided_getattr

__all__ = [
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
]
__getattr__ = not_provided_getattr(__name__)
