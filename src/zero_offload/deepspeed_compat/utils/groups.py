"""``deepspeed.utils.groups``: the process-group queries for zero_offload's one kind of
parallelism, data parallelism over the whole world. Model, sequence and expert parallel worlds
are of size 1; their process groups do not exist (asking for one raises
``DeepSpeedNotProvidedError``)."""

from __future__ import annotations

import torch.distributed as _dist

from .._common import DeepSpeedNotProvidedError, not_provided_getattr
from ..comm import get_rank, get_world_size

__getattr__ = not_provided_getattr(__name__)


def _get_data_parallel_group():
    return _dist.group.WORLD if _dist.is_initialized() else None


def _get_data_parallel_world_size() -> int:
    return get_world_size()


def _get_data_parallel_rank() -> int:
    return get_rank()


get_data_parallel_group = _get_data_parallel_group
get_data_parallel_world_size = _get_data_parallel_world_size
get_data_parallel_rank = _get_data_parallel_rank
_get_sequence_data_parallel_group = _get_data_parallel_group
_get_sequence_data_parallel_world_size = _get_data_parallel_world_size
_get_sequence_data_parallel_rank = _get_data_parallel_rank


def _get_model_parallel_world_size() -> int:
    return 1


def _get_sequence_parallel_world_size() -> int:
    return 1


def _get_sequence_parallel_rank() -> int:
    return 0


def _get_sequence_parallel_group():
    raise DeepSpeedNotProvidedError(
        "deepspeed.utils.groups._get_sequence_parallel_group", " (no sequence parallelism)"
    )


def get_model_parallel_world_size() -> int:
    return 1


def get_tensor_model_parallel_world_size() -> int:
    return 1


def get_model_parallel_rank() -> int:
    return 0


def get_tensor_model_parallel_rank() -> int:
    return 0
