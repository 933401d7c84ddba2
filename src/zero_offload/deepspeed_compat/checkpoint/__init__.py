"""``deepspeed.checkpoint``: ``utils.clone_tensors_for_torch_save`` and ``constants``, the names
of DeepSpeed's checkpoint format."""

from .._common import not_provided_getattr
from . import constants, utils  # noqa: F401

__getattr__ = not_provided_getattr(
    __name__,
    {"DeepSpeedCheckpoint": " (zero-offload convert-deepspeed reads DeepSpeed checkpoints)"},
)
