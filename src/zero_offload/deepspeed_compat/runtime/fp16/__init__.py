"""``deepspeed.runtime.fp16``: ``loss_scaler``, the classes a DeepSpeed checkpoint pickles."""

from ..._common import not_provided_getattr
from . import loss_scaler  # noqa: F401

__getattr__ = not_provided_getattr(__name__)
