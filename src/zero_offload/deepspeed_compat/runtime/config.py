"""``deepspeed.runtime.config``: the config error type (a ``zero_offload.config.ConfigError``
is also a ``DeepSpeedConfigError``)."""

from ...config import DeepSpeedConfigError
from .._common import not_provided_getattr

__all__ = ["DeepSpeedConfigError"]
__getattr__ = not_provided_getattr(__name__)
