"""``deepspeed.runtime.zero.offload_config``: DeepSpeed's offload enums and the config models of
``offload_optimizer`` and ``offload_param``, as the project's own (same fields, defaults,
validation and errors as inside a config file)."""

from ....config.zero.zero_optimization import (
    OffloadDeviceEnum,
    OffloadOptimizerConfig,
    OffloadParamConfig,
)
from ....runtime.update.buffers import OffloadStateType as OffloadStateTypeEnum
from ..._common import not_provided_getattr

# DeepSpeed's class names for the same sections (isinstance checks on a validated config hold;
# ``pipeline`` is the model's own derived property, ``ratio`` one of its fields).
DeepSpeedZeroOffloadOptimizerConfig = OffloadOptimizerConfig
DeepSpeedZeroOffloadParamConfig = OffloadParamConfig

__all__ = [
    "DeepSpeedZeroOffloadOptimizerConfig",
    "DeepSpeedZeroOffloadParamConfig",
    "OffloadDeviceEnum",
    "OffloadStateTypeEnum",
]
__getattr__ = not_provided_getattr(__name__)
