"""``deepspeed.runtime.torch_autocast``: DeepSpeed's per-parameter communication-dtype queries.

The ``torch_autocast`` config section itself is not built here (it is accepted with the
not-implemented warning): the engine marks no parameter, so every parameter's communication
dtype is its own dtype and ``is_autocast_initialized()`` is false."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .._common import not_provided_getattr

# The attribute DeepSpeed sets on a parameter whose gradient it communicates in a lower dtype.
PARAM_COMM_DTYPE_ATTR_NAME = "comm_dtype"

# DeepSpeed's default "lower_precision_safe_modules".
LOWER_PRECISION_SAFE_MODULES: list[type[torch.nn.Module]] = [
    torch.nn.Linear,
    torch.nn.Conv1d,
    torch.nn.Conv2d,
    torch.nn.Conv3d,
]


def is_autocast_initialized() -> bool:
    """False: no engine here marks parameters for ``torch_autocast``."""
    return False


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
    "is_autocast_initialized",
]
__getattr__ = not_provided_getattr(__name__)
