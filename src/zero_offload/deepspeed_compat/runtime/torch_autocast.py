"""``deepspeed.runtime.torch_autocast``: DeepSpeed's per-parameter communication-dtype queries.

With the ``torch_autocast`` section enabled, the engine marks the params of its
``lower_precision_safe_modules`` with the autocast dtype (``param.comm_dtype``); an unmarked
param's communication dtype is its own dtype."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ...runtime.precision.autocast import DEFAULT_SAFE_MODULES, PARAM_COMM_DTYPE_ATTR_NAME
from .._common import not_provided_getattr

# DeepSpeed's default "lower_precision_safe_modules".
LOWER_PRECISION_SAFE_MODULES: list[type[torch.nn.Module]] = list(DEFAULT_SAFE_MODULES)


def get_default_autocast_lower_precision_modules() -> list[str]:
    """The qualified class names of :data:`LOWER_PRECISION_SAFE_MODULES`."""
    return [f"{cls.__module__}.{cls.__name__}" for cls in LOWER_PRECISION_SAFE_MODULES]


def has_comm_dtype(param: torch.Tensor) -> bool:
    """Whether ``param`` carries a communication dtype of its own."""
    return hasattr(param, PARAM_COMM_DTYPE_ATTR_NAME)


def get_comm_dtype(param: torch.Tensor) -> torch.dtype:
    """``param``'s communication dtype: the one it carries, else its own dtype."""
    return getattr(param, PARAM_COMM_DTYPE_ATTR_NAME, param.dtype)


def get_all_comm_dtypes(params: Iterable[torch.Tensor]) -> set[torch.dtype]:
    """The set of :func:`get_comm_dtype` over ``params``."""
    return {get_comm_dtype(p) for p in params}


__all__ = [
    "LOWER_PRECISION_SAFE_MODULES",
    "PARAM_COMM_DTYPE_ATTR_NAME",
    "get_all_comm_dtypes",
    "get_comm_dtype",
    "get_default_autocast_lower_precision_modules",
    "has_comm_dtype",
]
__getattr__ = not_provided_getattr(__name__)
