"""Typed DeepSpeed-style configuration: ``load_config(source, world_size)`` -> ZeroOffloadConfig."""

from .aio import AioConfig
from .auto import AutoValueWarning
from .auto_sizes import resolve_auto_sizes
from .batch import BatchSizes, resolve_batch_sizes
from .errors import (
    ConfigError,
    DeepSpeedConfigError,
    NotImplementedSettingWarning,
    SettingSpellingWarning,
)
from .fields import FrozenConfigError
from .json_text import parse_json_text, read_json_file
from .load import ConfigSource, load_config
from .models import ZeroOffloadConfig
from .optimizer import AdamParams, OptimizerConfig
from .precision import BF16Config, FP16Config
from .scheduler import (
    SchedulerConfig,
    WarmupCosineLRConfig,
    WarmupCosineLRParams,
    WarmupDecayLRConfig,
    WarmupDecayLRParams,
    WarmupLRConfig,
    WarmupLRParams,
)
from .zero import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig

__all__ = [
    "AdamParams",
    "AioConfig",
    "AutoValueWarning",
    "BF16Config",
    "BatchSizes",
    "ConfigError",
    "ConfigSource",
    "DeepSpeedConfigError",
    "FP16Config",
    "FrozenConfigError",
    "NotImplementedSettingWarning",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "SettingSpellingWarning",
    "WarmupCosineLRConfig",
    "WarmupCosineLRParams",
    "WarmupDecayLRConfig",
    "WarmupDecayLRParams",
    "WarmupLRConfig",
    "WarmupLRParams",
    "ZeroConfig",
    "ZeroOffloadConfig",
    "load_config",
    "parse_json_text",
    "read_json_file",
    "resolve_auto_sizes",
    "resolve_batch_sizes",
]
