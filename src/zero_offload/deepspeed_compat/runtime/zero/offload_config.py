"""``deepspeed.runtime.zero.offload_config``: DeepSpeed's offload enums and the config models of
``offload_optimizer`` and ``offload_param``, as the project's own (same fields, defaults,
validation and errors as inside a config file)."""

from ....config.zero import OffloadDeviceEnum, OffloadOptimizerConfig, OffloadParamConfig
from ....runtime.engine.state_inventory import OffloadStateType as OffloadStateTypeEnum
from ..._common import not_provided_getattr


class DeepSpeedZeroOffloadOptimizerConfig(OffloadOptimizerConfig):
    """DeepSpeed's name for the ``offload_optimizer`` model (``ratio`` included)."""

    @property
    def pipeline(self) -> bool:
        """DeepSpeed's derived flag: ``pipeline_read or pipeline_write``."""
        return bool(self.pipeline_read or self.pipeline_write)


class DeepSpeedZeroOffloadParamConfig(OffloadParamConfig):
    """DeepSpeed's name for the ``offload_param`` model."""


__all__ = [
    "DeepSpeedZeroOffloadOptimizerConfig",
    "DeepSpeedZeroOffloadParamConfig",
    "OffloadDeviceEnum",
    "OffloadStateTypeEnum",
]
__getattr__ = not_provided_getattr(__name__)
