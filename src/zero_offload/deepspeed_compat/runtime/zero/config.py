"""``deepspeed.runtime.zero.config``: ``DeepSpeedZeroConfig`` (the ``zero_optimization``
section built from keyword arguments, as DeepSpeed's engine builds it from the config dict),
``ZeroStageEnum`` and the offload and leaf-module sections.

``DeepSpeedZeroConfig`` is this project's ``ZeroConfig``: the same keys, defaults, aliases and
checks as a config file's ``zero_optimization`` (a bad value is a ``ConfigError`` naming the
key, which is also the ``ValueError`` DeepSpeed's pydantic model raises). DeepSpeed's field names
for the stage-3 settings (``prefetch_bucket_size``, ...; the ``stage3_`` spellings are their
aliases) read the same values. A key DeepSpeed accepts and this project does not build is
accepted with the not-implemented warning; reading it gives the value given (else DeepSpeed's
default), so it can be inspected, and nothing acts on it."""

from __future__ import annotations

import warnings
from enum import Enum
from typing import Any

from pydantic import PrivateAttr, ValidationError

from ....config.errors import ConfigError, NotImplementedSettingWarning
from ....config.loading import unbuilt
from ....config.loading.keys import describe_errors, prepare
from ....config.models import ZeroOffloadConfig
from ....config.zero.zero_optimization import ZeroConfig
from ..._common import not_provided_getattr
from .leaf_module_config import DeepSpeedZeroLeafModuleConfig  # noqa: F401
from .offload_config import (  # noqa: F401
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
    OffloadDeviceEnum,
)

SECTION = "zero_optimization"


class ZeroStageEnum(int, Enum):
    """DeepSpeed's ZeRO stages (an int: ``ZeroStageEnum.weights == 3``)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


# DeepSpeed's field name -> this project's field for the stage-3 settings.
_DEEPSPEED_FIELD = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "model_persistence_threshold": "stage3_model_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
}

# DeepSpeed's defaults of the keys accepted and not built (read back when not given).
_UNBUILT_DEFAULTS: dict[str, Any] = {
    "module_granularity_threshold": 0,
    "use_all_reduce_for_fetch_params": False,
    "allgather_sequential": False,
    "partition_stream_chunk_size": None,
    "zero_hpz_partition_size": 1,
    "zero_quantized_weights": False,
    "zero_quantized_nontrainable_weights": False,
    "zero_quantized_gradients": False,
    "pipeline_loading_checkpoint": False,
    "override_module_apply": True,
    "log_trace_cache_warnings": False,
    "save_muon_momentum_buffer_in_memory": False,
    "legacy_stage1": False,
    "cpu_offload_use_pin_memory": None,
}


def _unbuilt_key(key: str) -> str:
    """The DeepSpeed field a not-built key sets (``stage3_allgather_sequential`` ->
    ``allgather_sequential``)."""
    plain = key.removeprefix("stage3_")
    return plain if plain in _UNBUILT_DEFAULTS else key


def _validated_fields(data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the keys this project builds, the DeepSpeed keys it accepts and ignores, by DeepSpeed
    field name). An unknown key is a ConfigError naming it; the ignored ones are warned."""
    prepared = prepare({SECTION: data}, ZeroOffloadConfig)
    if prepared.problems:
        raise ConfigError(prepared.problems, origin="<DeepSpeedZeroConfig>")
    prefix = f"{SECTION}."
    ignored = {
        _unbuilt_key(path.removeprefix(prefix)): data[path.removeprefix(prefix)]
        for path in prepared.ignored
        if path.removeprefix(prefix) in data
    }
    changed = unbuilt.notes(prepared.ignored_values)
    if changed:
        warnings.warn(
            "DeepSpeedZeroConfig: DeepSpeed settings accepted but not built here, so this run "
            f"differs from DeepSpeed's: {'; '.join(changed)}",
            NotImplementedSettingWarning,
            stacklevel=3,
        )
    return prepared.data.get(SECTION, {}), ignored


class DeepSpeedZeroConfig(ZeroConfig):
    """``DeepSpeedZeroConfig(**zero_optimization_dict)``: see the module's description."""

    _unbuilt: dict[str, Any] = PrivateAttr(default_factory=dict)

    def __init__(self, **data: Any) -> None:
        fields, ignored = _validated_fields(data)
        try:
            super().__init__(**fields)
        except ValidationError as exc:
            lines = [f"{SECTION}.{line}" for line in describe_errors(ZeroConfig, exc, set())]
            raise ConfigError(lines, origin="<DeepSpeedZeroConfig>") from None
        self._settle(_unbuilt=ignored)

    def __getattr__(self, name: str) -> Any:
        if name in _DEEPSPEED_FIELD:
            return getattr(self, _DEEPSPEED_FIELD[name])
        if name in _UNBUILT_DEFAULTS:
            private = self.__pydantic_private__ or {}
            return private.get("_unbuilt", {}).get(name, _UNBUILT_DEFAULTS[name])
        return super().__getattr__(name)


__all__ = [
    "DeepSpeedZeroConfig",
    "DeepSpeedZeroLeafModuleConfig",
    "DeepSpeedZeroOffloadOptimizerConfig",
    "DeepSpeedZeroOffloadParamConfig",
    "OffloadDeviceEnum",
    "ZeroStageEnum",
]
__getattr__ = not_provided_getattr(__name__)
