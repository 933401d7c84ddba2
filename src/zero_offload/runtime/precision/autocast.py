"""The ``torch_autocast`` section at run time: the forward's autocast context and the
communication-dtype marks on the lower-precision-safe modules' params (DeepSpeed's
``comm_dtype`` attribute, read through ``deepspeed.runtime.torch_autocast``).

Invariant: with the section disabled the forward runs in whatever autocast state the caller
set (nothing is entered) and no param is marked."""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass

import torch

from ...config.errors import ConfigError
from ...config.precision.torch_autocast import TorchAutocastConfig
from .loss_scaler import DynamicLossScaler

PARAM_COMM_DTYPE_ATTR_NAME = "comm_dtype"
DEFAULT_SAFE_MODULES: tuple[type[torch.nn.Module], ...] = (
    torch.nn.Linear,
    torch.nn.Conv1d,
    torch.nn.Conv2d,
    torch.nn.Conv3d,
)


def _safe_classes(names: list[str] | None) -> tuple[type, ...]:
    """The classes named in ``lower_precision_safe_modules`` (None: the defaults)."""
    if names is None:
        return DEFAULT_SAFE_MODULES
    found = []
    for name in names:
        module_name, _, class_name = name.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError, ValueError) as exc:
            raise ConfigError(
                f"torch_autocast.lower_precision_safe_modules: cannot import {name!r} (a fully "
                f"qualified class name, e.g. 'torch.nn.Linear'): {exc}"
            ) from None
        found.append(cls)
    return tuple(found)


def grad_scaler_for_fp16(min_scale: float) -> DynamicLossScaler:
    """The loss scaling of fp16 autocast: torch's ``GradScaler`` defaults, which DeepSpeed uses
    for it (start at 2**16, halve on every overflow, double after 2000 clean steps), floored at
    ``min_scale`` (the ``fp16.min_loss_scale`` the overflow monitor stops at)."""
    return DynamicLossScaler(
        init_scale=2.0**16,
        scale_factor=2.0,
        scale_window=2000,
        min_scale=min_scale,
        delayed_shift=1,
    )


@dataclass(frozen=True)
class AutocastPolicy:
    """Whether and how the engine's forward runs under ``torch.autocast``."""

    enabled: bool
    device_type: str
    dtype: torch.dtype

    @classmethod
    def from_config(cls, config: TorchAutocastConfig, device: torch.device) -> AutocastPolicy:
        dtype = config.torch_dtype or torch.get_autocast_dtype(device.type)
        return cls(bool(config.enabled), device.type, dtype)

    @property
    def scales_loss(self) -> bool:
        """fp16 autocast needs loss scaling (DeepSpeed adds a gradient scaler for it)."""
        return self.enabled and self.dtype == torch.float16

    def mark_params(self, module: torch.nn.Module, names: list[str] | None) -> None:
        """Mark each safe module's own params with the autocast dtype (enabled only)."""
        if not self.enabled:
            return
        classes = _safe_classes(names)
        for sub in module.modules():
            if type(sub) in classes:
                for p in sub.parameters(recurse=False):
                    setattr(p, PARAM_COMM_DTYPE_ATTR_NAME, self.dtype)

    def context(self) -> contextlib.AbstractContextManager:
        """The forward's autocast (entered only when enabled)."""
        if not self.enabled:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)
