"""Typed DeepSpeed-style configuration: ``load_config(source, world_size)`` -> ZeroOffloadConfig."""

from .batch import BatchSizes, resolve_batch_sizes
from .errors import (
    ConfigError,
    DeepSpeedConfigError,
    NotImplementedSettingWarning,
    SettingSpellingWarning,
)
from .fields import FrozenConfigError
from .loading.auto import AutoValueWarning
from .loading.auto_sizes import resolve_auto_sizes
from .loading.json_text import parse_json_text, read_json_file
from .loading.load import ConfigSource, load_config
from .models import ZeroOffloadConfig
from .optim.optimizer import AdamParams, OptimizerConfig
from .optim.scheduler import (
    SchedulerConfig,
    WarmupCosineLRConfig,
    WarmupCosineLRParams,
    WarmupDecayLRConfig,
    WarmupDecayLRParams,
    WarmupLRConfig,
    WarmupLRParams,
)
from .precision.fp16_bf16 import BF16Config, FP16Config
from .zero.aio import AioConfig
from .zero.zero_optimization import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig

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
