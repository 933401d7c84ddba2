"""``zero_optimization.allgather_bucket_size`` at stages 1 and 2 must be a multiple of 2
(DeepSpeed's ``nccl_start_alignment_factor``); DeepSpeed asserts it when it builds its ZeRO
optimizer, so an odd value is an ``AssertionError`` with DeepSpeed's words here too. Stages 0 and
3 do not read the key, as in DeepSpeed."""

from __future__ import annotations

import pytest

from zero_offload.config import ConfigError, load_config


def _config(stage: int, size: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": stage, "allgather_bucket_size": size},
    }


@pytest.mark.parametrize("stage", [1, 2])
def test_odd_allgather_bucket_is_refused_at_stages_1_and_2(stage: int) -> None:
    with pytest.raises(AssertionError) as info:
        load_config(_config(stage, 1001))
    assert isinstance(info.value, ConfigError)
    message = str(info.value)
    assert "zero_optimization.allgather_bucket_size" in message
    assert "must be a multiple of nccl_start_alignment_factor, 2" in message


@pytest.mark.parametrize(("stage", "size"), [(0, 1001), (3, 1001), (1, 1000), (2, 1000)])
def test_even_bucket_or_stage_without_the_key_loads(stage: int, size: int) -> None:
    assert load_config(_config(stage, size)).zero_optimization.allgather_bucket_size == size
