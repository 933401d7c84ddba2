"""Loading DeepSpeed's ``.pt`` files without running code from them.

DeepSpeed pickles its checkpoints. ``torch.load(weights_only=True)`` rebuilds only tensors and
plain containers; the few DeepSpeed objects inside (its loss scaler, its ZeRO stage enum, the
``fragment_address`` tuples) are allowed by name and rebuilt as the inert stand-ins below, which
hold their pickled fields as data and have no behaviour. Any other global makes the load fail
with an error naming it: nothing outside this allowlist is ever constructed or called.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch

from ..format import CheckpointError


class PickledState:
    """A DeepSpeed object's pickled ``__dict__``, as data (e.g. a loss scaler's ``cur_scale``)."""

    def __setstate__(self, state: Any) -> None:
        self.state = state if isinstance(state, dict) else {"value": state}

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, "state", {}).get(key, default)


class LossScaler(PickledState):
    pass


class DynamicLossScaler(PickledState):
    pass


class FragmentAddress(PickledState):
    """DeepSpeed's ``fragment_address`` dataclass (numel, start)."""


def _enum_value(value: Any) -> Any:
    """DeepSpeed's enums (ZeroStageEnum, OffloadDeviceEnum) pickle as ``Enum(value)``."""
    return value


_ALLOWLIST: list[tuple[Any, str]] = [
    (LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (DynamicLossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
    (_enum_value, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (_enum_value, "deepspeed.runtime.zero.offload_config.OffloadDeviceEnum"),
]


def load_deepspeed_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``torch.load(path, weights_only=True)`` with DeepSpeed's few objects allowed as data."""
    try:
        with torch.serialization.safe_globals(_ALLOWLIST):
            data = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"{path}: holds a pickled object outside the allowlist of DeepSpeed checkpoint "
            f"types, so it was not loaded (no code from it ran): {first}"
        ) from None
    except (OSError, RuntimeError, EOFError) as exc:
        raise CheckpointError(
            f"{path}: cannot be read as a DeepSpeed checkpoint file: {exc}"
        ) from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a dict, got {type(data).__name__}")
    return data
