"""A validated config is read-only: every holder sees the settings it was validated with, and a
change is a new validated config (``ZeroOffloadConfig.updated``) that checks every rule again."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest

from zero_offload.config import ConfigError, FrozenConfigError, ZeroOffloadConfig, load_config

BASE = {
    "train_batch_size": 8,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "cpu_offload": True},
    "aio": {"thread_count": 4},
}


def _load(world_size: int = 2) -> ZeroOffloadConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the "auto" note
        return load_config(BASE, world_size)


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("train_batch_size", 16),
        ("zero_optimization.reduce_bucket_size", 4096),
        ("zero_optimization.offload_optimizer.device", "none"),
        ("optimizer.params.lr", 0.1),
        ("aio.intra_op_parallelism", 2),
        ("checkpoint.tag_validation", "fail"),
        ("_world_size", 4),  # private state too
        ("_source", {}),
    ],
)
def test_assignment_is_refused_and_names_the_key(path: str, value: object) -> None:
    cfg = _load()
    *parents, name = path.split(".")
    section = cfg
    for part in parents:
        section = getattr(section, part)
    before = cfg.to_dict()
    with pytest.raises(FrozenConfigError, match=rf"\.{name}: a validated config is read-only"):
        setattr(section, name, value)
    with pytest.raises(FrozenConfigError):
        delattr(section, name)
    assert cfg.to_dict() == before and cfg.world_size == 2


def test_validators_still_finish_the_config() -> None:
    """What the validators settle (the batch triple, deprecated spellings, overlap_comm's
    stage-dependent default, aio's thread spelling) is in place on the read-only result."""
    cfg = _load()
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu) == (8, 2)
    zc = cfg.zero_optimization
    assert zc.offload_device == "cpu" and zc.cpu_offload is None and zc.overlap_comm is True
    assert cfg.aio.threads == 4 and cfg.aio.thread_count is None
    assert cfg.auto_keys == frozenset({"zero_optimization.reduce_bucket_size"})


def test_updated_is_a_new_validated_config() -> None:
    cfg = _load()
    new = cfg.updated(
        {
            "train_batch_size": 16,
            "gradient_accumulation_steps": 4,
            "zero_optimization": {"reduce_bucket_size": 4096},
        }
    )
    assert (new.train_batch_size, new.gradient_accumulation_steps) == (16, 4)
    assert new.zero_optimization.reduce_bucket_size == 4096
    # Untouched settings and what load_config recorded carry over; the original is unchanged.
    assert new.zero_optimization.offload_device == "cpu" and new.optimizer == cfg.optimizer
    assert (new.world_size, new.auto_keys) == (cfg.world_size, cfg.auto_keys)
    assert load_config(new, 1).train_batch_size == 8  # reloads from the source for a new world
    assert (cfg.train_batch_size, cfg.zero_optimization.reduce_bucket_size) == (8, 500_000_000)
    with pytest.raises(FrozenConfigError):
        new.train_batch_size = 1


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"train_batch_size": 12}, "train_batch_size 12 != train_micro_batch_size_per_gpu 2"),
        ({"zero_optimization": {"stage": 1}}, "offload_param"),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "bf16.enabled"),
        ({"zero_optimization": {"reduce_bucket_size": 0}}, "zero_optimization.reduce_bucket_size"),
    ],
)
def test_updated_checks_every_rule(changes: dict, message: str) -> None:
    cfg = _load()
    if "offload_param" in message:  # a stage-3 only setting kept while the stage drops
        cfg = cfg.updated({"zero_optimization": {"offload_param": {"device": "cpu"}}})
    with pytest.raises(ConfigError, match=message):
        cfg.updated(changes)


def test_engine_runs_with_the_resolved_config_and_leaves_the_given_one() -> None:
    """The engine fills "auto" sizes into a new config of its own (resolve_auto_sizes)."""
    import torch

    import zero_offload

    model = torch.nn.Linear(4, 4)
    model.config = SimpleNamespace(hidden_size=8)  # type: ignore[assignment]
    given = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW"},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
    }
    cfg = load_config(given, 1)
    engine, *_ = zero_offload.initialize(model=model, config=cfg)
    try:
        assert engine.config.zero_optimization.reduce_bucket_size == 64  # h*h
        assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
        assert engine.config.auto_keys == cfg.auto_keys
    finally:
        engine.destroy()
