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


_EXPECTED = (
    "expected a dict saved by torch.save (DeepSpeed's .pt format) holding only tensors, plain "
    "containers and the allowlisted DeepSpeed types"
)


def _core(message: str) -> str:
    """The one informative line of torch's weights-only error (it wraps it in advice)."""
    text = message.split("Check the documentation of torch.load")[0]
    if "WeightsUnpickler error:" in text:
        text = text.rsplit("WeightsUnpickler error:", 1)[1]
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        return lines[0] if lines else ""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def load_deepspeed_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``torch.load(path, weights_only=True)`` with DeepSpeed's few objects allowed as data."""
    try:
        with torch.serialization.safe_globals(_ALLOWLIST):
            data = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        core = _core(str(exc)) or type(exc).__name__
        if "GLOBAL" in core:  # torch's advice to allowlist it is not for this reader
            core = core.split(". Please use")[0]
            raise CheckpointError(
                f"{path}: holds a pickled object outside the allowlist of DeepSpeed checkpoint "
                f"types, so it was not loaded (no code from it ran): {core}"
            ) from None
        raise CheckpointError(
            f"{path}: not a DeepSpeed checkpoint file: {_EXPECTED}; it could not be unpickled "
            f"safely, so nothing in it ran ({core})"
        ) from None
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file is missing") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path}: is a folder; {_EXPECTED}") from None
    except PermissionError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc.strerror})") from None
    except Exception as exc:  # noqa: BLE001 - bytes that are not a pickle fail in many ways
        detail = _core(str(exc)) or "no detail"
        raise CheckpointError(
            f"{path}: not a DeepSpeed checkpoint file (damaged, or another kind of file): "
            f"{_EXPECTED} ({type(exc).__name__}: {detail})"
        ) from None
    if not isinstance(data, dict):
        raise CheckpointError(
            f"{path}: holds a {type(data).__name__}, not a DeepSpeed checkpoint: expected a dict "
            "(DeepSpeed saves each .pt file as a dict of its state)"
        )
    return data
