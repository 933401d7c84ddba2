"""``deepspeed.checkpoint``: ``utils.clone_tensors_for_torch_save``."""

from .._common import not_provided_getattr
from . import utils  # noqa: F401

__getattr__ = not_provided_getattr(
    __name__,
    {"DeepSpeedCheckpoint": " (zero-offload convert-deepspeed reads DeepSpeed checkpoints)"},
)
