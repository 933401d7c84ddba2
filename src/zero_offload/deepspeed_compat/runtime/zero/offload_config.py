"""``deepspeed.runtime.zero.offload_config``: the offload device enum and the two offload
sections, as this project's config models (the same keys, defaults and checks)."""

from __future__ import annotations

from enum import Enum

from ....config.zero import OffloadOptimizerConfig, OffloadParamConfig
from ..._common import not_provided_getattr


class OffloadDeviceEnum(str, Enum):
    """DeepSpeed's offload devices: a member is its JSON string (``"cpu"``), so it can be
    written into a config dict as the device."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


# DeepSpeed's class names for the same sections (isinstance checks on a validated config hold).
DeepSpeedZeroOffloadOptimizerConfig = OffloadOptimizerConfig
DeepSpeedZeroOffloadParamConfig = OffloadParamConfig

__all__ = [
    "DeepSpeedZeroOffloadOptimizerConfig",
    "DeepSpeedZeroOffloadParamConfig",
    "OffloadDeviceEnum",
]
__getattr__ = not_provided_getattr(__name__)
