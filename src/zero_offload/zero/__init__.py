"""DeepSpeed's ``deepspeed.zero`` names: build partitioned models (``Init``), see or edit full
params of a partitioned model (``GatheredParameters``), and declare cross-module param use."""

from ..core.status import ZeroParamStatus
from .gathered import GatheredParameters, register_external_parameter, unwrap_model_for_generation
from .init import Init

__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "register_external_parameter",
    "unwrap_model_for_generation",
]
