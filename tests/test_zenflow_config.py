"""``zero_optimization.zenflow``: DeepSpeed 0.19.8's keys and defaults, its refusals (each
naming the key), and the schedule its "auto" values resolve to."""

from __future__ import annotations

import pytest

from zero_offload.config import ConfigError, load_config
from zero_offload.config.zero.zenflow import ZenFlowConfig, resolve_schedule


def cfg(zenflow: dict, **zero) -> dict:
    z = {"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": zenflow, **zero}
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": z}


def problems(config: dict) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(config, 1)
    return str(info.value)


def test_auto_is_deepspeeds_value_not_a_fill_in():
    import warnings

    auto = {"select_strategy": "auto", "select_interval": "auto", "update_interval": "auto"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        zf = load_config(cfg(auto), 1).zero_optimization.zenflow
    assert (zf.select_strategy, zf.select_interval, zf.update_interval) == ("auto",) * 3


def test_defaults_are_deepspeeds():
    zf = load_config(cfg({}), 1).zero_optimization.zenflow
    assert (zf.topk_ratio, zf.select_strategy, zf.select_interval, zf.update_interval) == (
        0.1,
        "auto",
        "auto",
        "auto",
    )
    assert (zf.overlap_step, zf.offload, zf.auto_ratio, zf.full_warm_up_rounds) == (
        False,
        False,
        0.99,
        0,
    )
    assert zf.pt_reserved_cores_perc == 0.5
    assert load_config(cfg(None), 1).zero_optimization.zenflow is None


@pytest.mark.parametrize(
    "zenflow, key",
    [
        ({"topk_ratio": 0.0}, "zenflow.topk_ratio"),
        ({"topk_ratio": 1.0}, "zenflow.topk_ratio"),
        ({"select_strategy": "often"}, "zenflow.select_strategy"),
        ({"select_interval": "soon"}, "zenflow.select_interval"),
        ({"update_interval": 0}, "zenflow.update_interval"),
        ({"update_interval": "later"}, "zenflow.update_interval"),
        ({"auto_ratio": 1.5}, "zenflow.auto_ratio"),
        ({"full_warm_up_rounds": 1.5}, "zenflow.full_warm_up_rounds"),
        ({"pt_reserved_cores_perc": -0.1}, "zenflow.pt_reserved_cores_perc"),
        ({"topk_ratoi": 0.1}, "topk_ratoi"),
    ],
)
def test_bad_values_name_the_key(zenflow, key):
    assert key in problems(cfg(zenflow))


def test_needs_cpu_optimizer_offload():
    c = cfg({})
    del c["zero_optimization"]["offload_optimizer"]
    assert 'zero_optimization.zenflow: needs offload_optimizer.device "cpu"' in problems(c)
    c["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": "/tmp"}
    assert "zenflow" in problems(c)


def test_offload_needs_overlap_comm():
    assert "zenflow.offload" in problems(cfg({"offload": True}))
    load_config(cfg({"offload": True}, overlap_comm=True), 1)


def test_schedule_resolution_as_deepspeed():
    s = resolve_schedule(ZenFlowConfig(), None)  # auto: epoch every 1 epoch; no loader: once
    assert (s.select_interval, s.update_interval, s.auto_update) == (0, 0, True)
    s = resolve_schedule(ZenFlowConfig(), 10)  # with a loader of 10 batches
    assert s.select_interval == 10
    step = ZenFlowConfig(select_strategy="step", select_interval=4, update_interval=2)
    s = resolve_schedule(step, None)
    assert (s.select_interval, s.update_interval, s.auto_update) == (4, 2, False)
    assert [k for k in range(8) if s.is_select(k)] == [0, 4]
    assert [k for k in range(8) if s.is_update(k)] == [1, 3, 5, 7]
    odd = resolve_schedule(
        ZenFlowConfig(select_strategy="step", select_interval=3, update_interval=2), None
    )
    assert [k for k in range(6) if odd.is_update(k)] == [1, 2, 3, 5]
    warm = resolve_schedule(
        ZenFlowConfig(
            select_strategy="step", select_interval=4, update_interval=2, full_warm_up_rounds=3
        ),
        None,
    )
    assert [k for k in range(8) if warm.is_update(k)] == [0, 1, 2, 3, 4, 6, 7]
    assert [k for k in range(9) if warm.is_select(k)] == [3, 4, 8]


@pytest.mark.parametrize(
    "zenflow, words",
    [
        ({"select_interval": 2}, 'with select_strategy "auto"'),
        ({"select_strategy": "step"}, "must be a number"),
        ({"select_strategy": "step", "select_interval": 1, "update_interval": 2}, "at least"),
    ],
)
def test_schedule_refusals_name_select_interval(zenflow, words):
    with pytest.raises(ValueError) as info:
        resolve_schedule(ZenFlowConfig(**zenflow), None)
    assert "zero_optimization.zenflow.select_interval" in str(info.value)
    assert words in str(info.value)


def test_refuses_what_deepspeed_cannot_combine():
    c = cfg({})
    c["zero_optimization"]["offload_optimizer"]["delayed_update"] = True
    assert "zenflow: cannot combine with offload_optimizer.delayed_update" in problems(c)
    c = cfg({})
    c["zero_optimization"]["stage"] = 3
    c["zero_optimization"]["offload_optimizer"]["ratio"] = 0.5
    assert "zenflow: needs offload_optimizer.ratio 1.0 (got 0.5)" in problems(c)
