"""Items: non-finite and out-of-range config values are errors at load naming the key."""

from __future__ import annotations

import json

import pytest

from zero_offload.config import ConfigError, load_config

BASE = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"}}


@pytest.mark.parametrize(
    "extra,key",
    [
        (
            {"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": float("inf")}}},
            "scheduler.params.warmup_max_lr",
        ),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": [float("nan")]}}},
            "scheduler.params.warmup_min_lr[0]",
        ),
        ({"optimizer": {"type": "AdamW", "params": {"lr": float("nan")}}}, "optimizer.params.lr"),
        (
            {"optimizer": {"type": "AdamW", "params": {"betas": [0.9, float("inf")]}}},
            "optimizer.params.betas[1]",
        ),
        ({"gradient_clipping": float("inf")}, "gradient_clipping"),
        ({"fp16": {"enabled": True, "initial_scale_power": 2000}}, "fp16.initial_scale_power"),
        ({"fp16": {"enabled": True, "loss_scale": 1e300}}, "fp16.loss_scale"),
        ({"seed": 1e30}, "seed"),
        ({"seed": 2**64}, "seed"),
        (
            {"zero_optimization": {"offload_optimizer": {"device": "cpu", "threads": 1e10}}},
            "zero_optimization.offload_optimizer.threads",
        ),
        (
            {"zero_optimization": {"reduce_bucket_size": 1e30}},
            "zero_optimization.reduce_bucket_size",
        ),
        ({"tensorboard": {"x": float("inf")}}, "tensorboard.x"),  # even in an ignored section
    ],
)
def test_bad_number_names_key(extra, key):
    with pytest.raises(ConfigError) as info:
        load_config({**BASE, **extra})
    lines = [p for p in info.value.problems if p.startswith(key + ":")]
    assert len(lines) == 1, info.value.problems  # named once, not once per validator


def test_json_1e999_is_rejected_naming_the_key(tmp_path):
    path = tmp_path / "c.json"
    text = json.dumps({**BASE, "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1}}})
    path.write_text(text.replace('"warmup_max_lr": 1', '"warmup_max_lr": 1e999'))
    with pytest.raises(ConfigError, match=r"scheduler\.params\.warmup_max_lr: expected a finite"):
        load_config(path)


def test_largest_valid_values_still_load():
    cfg = load_config(
        {
            **BASE,
            "seed": 2**63 - 1,
            "fp16": {"enabled": True, "initial_scale_power": 64},
            "zero_optimization": {
                "stage": 2,
                "offload_optimizer": {"device": "cpu", "threads": 1024},
            },
        }
    )
    assert cfg.seed == 2**63 - 1
