"""``deepspeed.runtime.activation_checkpointing``: its ``checkpointing`` module, which
``deepspeed.checkpointing`` names."""

from ..._common import not_provided_getattr
from . import checkpointing  # noqa: F401

__getattr__ = not_provided_getattr(__name__)
