"""``deepspeed.runtime.zero.leaf_module_config``: ``zero_optimization.leaf_module``'s defaults
and section (this project's model: the same keys, defaults, single-string and de-duplication
rules)."""

from __future__ import annotations

from ....config.zero.leaf_module import DEFAULT_LEAF_CLASSES, LeafModuleConfig
from ..._common import not_provided_getattr

DEFAULT_LEAF_MODULE_CLASSES: list[str] = list(DEFAULT_LEAF_CLASSES)
DEFAULT_LEAF_MODULE_NAMES: list[str] = []
DEFAULT_LEAF_MODULE_NAME_SUFFIXES: list[str] = []

DeepSpeedZeroLeafModuleConfig = LeafModuleConfig

__all__ = [
    "DEFAULT_LEAF_MODULE_CLASSES",
    "DEFAULT_LEAF_MODULE_NAMES",
    "DEFAULT_LEAF_MODULE_NAME_SUFFIXES",
    "DeepSpeedZeroLeafModuleConfig",
]
__getattr__ = not_provided_getattr(__name__)
