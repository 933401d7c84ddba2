"""``deepspeed.ops``: ``adam`` (zero_offload's ``DeepSpeedCPUAdam`` and ``FusedAdam``)."""

from .._common import not_provided_getattr
from . import adam  # noqa: F401

__getattr__ = not_provided_getattr(__name__)
