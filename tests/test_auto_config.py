"""``"auto"``: filled where something can fill it, otherwise one warning naming each key and
the default chosen; the set of "auto" paths stays on the config for the engine."""

from __future__ import annotations

import warnings

import pytest

from zero_offload.config import AutoValueWarning, load_config


def _load(raw, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(raw, **kw)
    auto = [str(w.message) for w in caught if issubclass(w.category, AutoValueWarning)]
    return cfg, auto


def test_one_warning_names_each_defaulted_key_and_value():
    cfg, warned = _load(
        {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_clipping": "auto",
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto"}},
            "bf16": {"enabled": "auto"},
            "fp16": {"enabled": "auto"},
        }
    )
    assert len(warned) == 1
    text = warned[0]
    for part in (
        "gradient_clipping=1.0",
        "optimizer.params.lr=0.001",
        "optimizer.params.betas=[0.9, 0.999]",
        "bf16.enabled=false",
        "fp16.enabled=false",
    ):
        assert part in text, (part, text)
    assert cfg.optimizer.params.lr == 1e-3 and not cfg.bf16.enabled
    assert set(cfg.auto_keys) >= {"optimizer.params.lr", "bf16.enabled"}


def test_filled_batch_keys_do_not_warn():
    cfg, warned = _load(
        {
            "train_batch_size": 16,
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": 2,
        },
        world_size=2,
    )
    assert warned == [] and cfg.train_micro_batch_size_per_gpu == 4
    cfg, warned = _load(
        {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"},
        micro_batch_size=3,
    )
    assert warned == [] and cfg.train_batch_size == 3
    # The micro batch alone: DeepSpeed's rule gives gradient_accumulation_steps 1.
    cfg, warned = _load(
        {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": "auto"}
    )
    assert warned == [] and cfg.gradient_accumulation_steps == 1


def test_engine_resolved_sizes_claim_no_default():
    cfg, warned = _load(
        {
            "train_micro_batch_size_per_gpu": 2,
            "zero_optimization": {
                "stage": 2,
                "reduce_bucket_size": "auto",
                "stage3_prefetch_bucket_size": "auto",
                "stage3_param_persistence_threshold": "auto",
            },
        }
    )
    assert warned == []
    assert {
        "zero_optimization.reduce_bucket_size",
        "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.stage3_param_persistence_threshold",
    } <= set(cfg.auto_keys)


def test_auto_with_no_default_is_an_error_naming_the_key():
    with pytest.raises(ValueError, match="scheduler.params.total_num_steps: required"):
        _load(
            {
                "train_batch_size": 1,
                "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}},
            }
        )
