"""The API's calls on its settings: DeepSpeed's ``configure``, ``is_configured``, ``reset``,
``model_parallel_cuda_manual_seed``, ``set_num_layers``, ``partition_activations_in_checkpoint``,
and the engine's ``configure_from_engine``."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from .policy import CheckpointPolicy
from .rng import model_parallel_cuda_manual_seed as _seed
from .settings import SETTINGS

_ARGUMENTS = {  # configure's keyword -> the policy field (the config key's meaning)
    "partition_activations": "partition_activations",
    "contiguous_checkpointing": "contiguous_memory_optimization",
    "num_checkpoints": "number_checkpoints",
    "checkpoint_in_cpu": "cpu_checkpointing",
    "synchronize": "synchronize",
    "profile": "profile",
}


# configure's keyword -> the config key it overrides
_CONFIG_KEYS = {
    "contiguous_checkpointing": "contiguous_memory_optimization",
    "num_checkpoints": "number_checkpoints",
    "checkpoint_in_cpu": "cpu_checkpointing",
    "synchronize": "synchronize_checkpoint_boundary",
}


def configure(
    mpu_: Any = None,
    deepspeed_config: Any = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """DeepSpeed's ``configure``: the defaults, then ``deepspeed_config``'s
    ``activation_checkpointing`` section (a dict, a JSON path or a loaded config), then each
    keyword given (not None)."""
    fields = dataclasses.asdict(CheckpointPolicy())
    if deepspeed_config is not None:
        fields.update(dataclasses.asdict(policy_of_config(deepspeed_config)))
    given = dict(
        partition_activations=partition_activations,
        contiguous_checkpointing=contiguous_checkpointing,
        num_checkpoints=num_checkpoints,
        checkpoint_in_cpu=checkpoint_in_cpu,
        synchronize=synchronize,
        profile=profile,
    )
    fields.update({_ARGUMENTS[k]: _checked(k, v) for k, v in given.items() if v is not None})
    SETTINGS.apply(CheckpointPolicy(**fields), mpu_)
    SETTINGS.by_script = True


def _checked(keyword: str, value: Any) -> Any:
    """A keyword of ``configure`` as its config key allows it (bool, or an integer > 0)."""
    key = f"activation_checkpointing.{_CONFIG_KEYS.get(keyword, keyword)}"
    if keyword == "num_checkpoints":
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(
                f"configure(num_checkpoints=...) ({key}): an integer > 0, got {value!r}"
            )
    elif not isinstance(value, bool):
        raise ValueError(f"configure({keyword}=...) ({key}): true or false, got {value!r}")
    return value


def policy_of_config(config: Any) -> CheckpointPolicy:
    """The policy of a config's ``activation_checkpointing`` section (a dict, a JSON path or a
    loaded config), validated as the engine validates it: errors name the key. Only that
    section is read (the batch keys may be another world size's)."""
    from ..config import ZeroOffloadConfig, load_config, read_json_file

    if not isinstance(config, (ZeroOffloadConfig, dict, str, os.PathLike)):
        raise TypeError(
            "configure(deepspeed_config=...): a config dict, the path of a JSON config or a "
            f"loaded config, got {type(config).__name__}"
        )
    if not isinstance(config, ZeroOffloadConfig):
        raw = read_json_file(config) if not isinstance(config, dict) else config
        section = raw.get("activation_checkpointing", {})
        config = load_config({"train_batch_size": 1, "activation_checkpointing": section})
    return CheckpointPolicy.from_section(config.activation_checkpointing)


def configure_from_engine(policy: CheckpointPolicy) -> bool:
    """The engine's call at ``initialize``: apply the config's section unless the script
    configured the API itself (its explicit call wins; a later engine's non-default section
    replaces an earlier engine's). True when applied."""
    if SETTINGS.by_script:
        return False
    SETTINGS.apply(policy)
    return True


def policy() -> CheckpointPolicy:
    """The policy ``checkpoint`` follows now."""
    return SETTINGS.policy


def is_configured() -> bool:
    return SETTINGS.configured


def reset() -> None:
    """DeepSpeed's ``reset`` frees contiguous buffers between eval forwards; a checkpoint here
    holds nothing once its graph is gone, so there is nothing to free. The configuration
    stays, as in DeepSpeed."""


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the device generator with ``seed`` and the tracked model-parallel state with
    ``seed + 2718 + tensor-model-parallel rank`` (0 without ``configure(mpu_)``)."""
    _seed(seed, SETTINGS.model_parallel()[0])


def set_num_layers(nlayers: int) -> None:
    SETTINGS.policy = dataclasses.replace(SETTINGS.policy, number_checkpoints=nlayers)


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    SETTINGS.apply(dataclasses.replace(SETTINGS.policy, partition_activations=partition_activation))
