"""``deepspeed.zero`` (= ``deepspeed.runtime.zero``): ``zero_offload.zero``'s names."""

from ....zero import unwrap_model_for_generation
from ..._common import not_provided_getattr
from . import partition_parameters  # noqa: F401
from .partition_parameters import (
    GatheredParameters,
    Init,
    ZeroParamStatus,
    register_external_parameter,
)

__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "partition_parameters",
    "register_external_parameter",
    "unwrap_model_for_generation",
]
__getattr__ = not_provided_getattr(__name__)
