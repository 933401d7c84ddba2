"""Issue: bad input that ended in a bare error far away, or in nothing at all: config values
past sane bounds, ``modifier_rank`` of the wrong type, a bad config given to ``zero.Init``, an
``nvme_path`` for a CPU offload, a param given a new shape inside ``GatheredParameters``."""

from __future__ import annotations

import warnings

import pytest
import torch
from distributed import every_rank
from parity import engine_config, make_model

import zero_offload
from zero_offload import zero
from zero_offload.config import ConfigError, load_config


@pytest.mark.parametrize(
    "extra,key",
    [
        ({"gradient_accumulation_steps": 10**9}, "gradient_accumulation_steps"),
        ({"optimizer": {"type": "AdamW", "params": {"lr": 1e30}}}, "optimizer.params.lr"),
        (
            {"zero_optimization": {"stage": 3, "sub_group_size": 0}},
            "zero_optimization.sub_group_size",
        ),
    ],
)
def test_values_past_sane_bounds_are_refused_by_key(extra, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config({"train_micro_batch_size_per_gpu": 1, **extra})


@pytest.mark.parametrize("section", ["offload_optimizer", "offload_param"])
def test_nvme_path_of_a_cpu_offload_is_named(section):
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    cfg["zero_optimization"][section] = {"device": "cpu", "nvme_path": "/local_nvme"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(cfg)
    assert any(f"zero_optimization.{section}.nvme_path" in str(w.message) for w in caught)


@pytest.mark.parametrize("bad", [0.5, "0", True])
def test_modifier_rank_must_be_an_int_rank(bad):
    model = make_model()
    with pytest.raises(ValueError, match="modifier_rank must be None or an int rank"):
        zero.GatheredParameters(model.l1.weight, modifier_rank=bad)


def test_zero_init_validates_its_config():
    with pytest.raises(ConfigError, match="zero_optimization.stage"):
        zero.Init(config_dict_or_path={"zero_optimization": {"stage": 9}})
    hf_style = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}  # fmt: skip
    assert zero.Init(config_dict_or_path=hf_style).dtype == torch.bfloat16


def _reshape_inside(world: int) -> dict:
    model = make_model()
    cfg = engine_config(3, False, 1, 2, 0.0, overlap=False,
                        zero_extra={"stage3_param_persistence_threshold": 0})  # fmt: skip
    engine, *_ = zero_offload.initialize(model=model, config=cfg)
    rank = zero_offload.comm.get_rank()
    p = model.l1.weight
    out = {"rank": rank}
    try:
        with zero.GatheredParameters(p, modifier_rank=0):
            if rank == 0:
                p.data = torch.zeros(3, 3)
    except ValueError as e:
        out["error"] = str(e)
    out["after"] = (p.numel(), tuple(p.ds_shape))
    with zero.GatheredParameters(p, modifier_rank=0):
        if rank == 0:
            p.data = torch.full(tuple(p.ds_shape), 0.25)  # same shape, new tensor: adopted
    with zero.GatheredParameters(p):
        out["adopted"] = bool((p == 0.25).all())
    engine.destroy()
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_new_shape_inside_gathered_parameters_is_refused_on_every_rank(world):
    ranks = [_reshape_inside(1)] if world == 1 else every_rank(2, _reshape_inside, 2)
    assert [r["rank"] for r in ranks] == list(range(world))
    for r in ranks:  # rank 1 made no edit, yet it must refuse too (or it leaves the collective)
        assert "given a new shape" in r.get("error", ""), r
        assert r["after"] == (0, (24, 16)), r
        assert r["adopted"], r
