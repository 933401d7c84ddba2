"""``deepspeed.runtime.fp16.loss_scaler``: ``LossScaler`` and ``DynamicLossScaler`` as the state
a DeepSpeed checkpoint pickles (its ``*_optim_states.pt`` holds the scaler object), so that
DeepSpeed's own ``zero_to_fp32.py`` loads a DeepSpeed checkpoint under the opt-in. They hold the
pickled fields as data (``cur_scale``, ...); zero_offload's engine scales losses itself
(``fp16`` in the config), so building one to train with is not provided."""

from __future__ import annotations

from typing import Any

from ...._as_deepspeed import DeepSpeedNotProvidedError
from ....checkpoint.deepspeed import pickle_safe
from ..._common import not_provided_getattr

_HINT = " (the loss scale is the fp16 section of the config: engine.loss_scale reads it)"


class LossScaler(pickle_safe.LossScaler):
    """DeepSpeed's static loss scaler, unpickled as data."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise DeepSpeedNotProvidedError(
            f"deepspeed.runtime.fp16.loss_scaler.{type(self).__name__}", _HINT
        )

    def __getattr__(self, name: str) -> Any:
        state = self.__dict__.get("state", {})
        if name in state:
            return state[name]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")


class DynamicLossScaler(LossScaler):
    """DeepSpeed's dynamic loss scaler, unpickled as data."""


__getattr__ = not_provided_getattr(__name__)
