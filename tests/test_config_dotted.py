"""Top-level keys written with dots (TRL's ``prepare_deepspeed``): applied as the nested key they
spell; a path that is not a key is an error naming the dotted key."""

from __future__ import annotations

import warnings

import pytest

from zero_offload.config import load_config
from zero_offload.config.errors import ConfigError

BASE = {
    "train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "prefetch_bucket_size": 7},
}


def _load(extra: dict):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_config({**BASE, **extra})


def test_trl_reference_model_keys_are_applied():
    """What prepare_deepspeed adds for hidden_size 64: the dotted value wins over the nested one
    (also over another spelling of the same setting), 0.9*64*64 is taken as an element count."""
    hidden = 64
    source = {
        **BASE,
        "zero_optimization.reduce_bucket_size": hidden * hidden,
        "zero_optimization.stage3_param_persistence_threshold": 10 * hidden,
        "zero_optimization.stage3_prefetch_bucket_size": 0.9 * hidden * hidden,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zero = load_config(source).zero_optimization
    assert zero.reduce_bucket_size == 4096
    assert zero.stage3_param_persistence_threshold == 640
    assert zero.stage3_prefetch_bucket_size == 3686
    assert source["zero_optimization"]["reduce_bucket_size"] == "auto"  # input untouched


def test_dotted_key_reaches_nested_sections():
    config = _load(
        {
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "optimizer.params.lr": 5e-4,
            "zero_optimization.offload_param.device": "cpu",
        }
    )
    assert config.optimizer.params.lr == 5e-4
    assert config.zero_optimization.offload_param.device == "cpu"


@pytest.mark.parametrize(
    "key, says",
    [
        ("zero_optimization.reduce_bucket_sise", 'did you mean "reduce_bucket_size"'),
        ("zero_optimizaton.stage", 'unknown key "zero_optimizaton"'),
        ("train_batch_size.x", '"train_batch_size" is a value'),
        ("zero_optimization.stage.x", '"zero_optimization.stage" is 3 here'),
        ("zero_optimization..stage", "empty segment"),
    ],
)
def test_invalid_path_names_the_dotted_key(key, says):
    with pytest.raises(ConfigError) as err:
        _load({key: 1})
    assert f'dotted key "{key}"' in str(err.value) and says in str(err.value)
