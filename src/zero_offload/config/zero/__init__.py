"""``zero_optimization``: the ZeRO stage and its buckets (``zero_optimization.py``), where the
optimizer state and the stage-3 params are offloaded (the same file), stage 3's leaf modules
(``leaf_module.py``) and the asynchronous I/O of NVMe offload (``aio.py``, DeepSpeed's top-level
``aio`` key, which only NVMe offload reads). Each sub-section of ``zero_optimization`` that grows
a model of its own gets a file here."""

from .aio import AioConfig
from .leaf_module import LeafModuleConfig
from .zero_optimization import (
    OFFLOAD_DEVICES,
    STAGE3_SPELLINGS,
    ZERO_NOT_IMPLEMENTED,
    OffloadDeviceEnum,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    ZeroConfig,
)

__all__ = [
    "OFFLOAD_DEVICES",
    "STAGE3_SPELLINGS",
    "ZERO_NOT_IMPLEMENTED",
    "AioConfig",
    "LeafModuleConfig",
    "OffloadDeviceEnum",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "ZeroConfig",
]
