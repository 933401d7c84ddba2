"""DeepSpeed's warmup schedules: lr at chosen steps against the formulas written out here."""

from __future__ import annotations

import math

import pytest
import torch

from zero_offload.config import load_config
from zero_offload.schedulers import (
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_lr_scheduler,
)


def make_optimizer(*lrs: float) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(3))], "lr": lr} for lr in lrs]
    return torch.optim.AdamW(groups)


def lrs_of(optimizer: torch.optim.Optimizer) -> list[float]:
    return [float(g["lr"]) for g in optimizer.param_groups]


def run_to(schedule, t: int) -> list[float]:
    """Step until last_batch_iteration == t (steps are taken one by one, not jumped)."""
    while schedule.last_batch_iteration < t:
        schedule.step()
    return lrs_of(schedule.optimizer)


# ---- formulas ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "t, expected",
    [
        (0, 0.0),
        (4, 0.01 * math.log(5) / math.log(10)),
        (9, 0.01),  # log warmup reaches the top one step before N: ln(10) / ln(10)
        (10, 0.01),
        (50, 0.01),
    ],
)
def test_warmup_lr_log(t: int, expected: float) -> None:
    opt = make_optimizer(0.5)
    schedule = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=0.01, warmup_num_steps=10)
    assert run_to(schedule, t) == pytest.approx([expected], rel=1e-12, abs=1e-15)


@pytest.mark.parametrize(
    "t, expected",
    [(0, 0.002), (4, 0.002 + 0.008 * 0.4), (9, 0.002 + 0.008 * 0.9), (10, 0.01), (11, 0.01)],
)
def test_warmup_lr_linear(t: int, expected: float) -> None:
    opt = make_optimizer(0.5)
    schedule = WarmupLR(
        opt, warmup_min_lr=0.002, warmup_max_lr=0.01, warmup_num_steps=10, warmup_type="linear"
    )
    assert run_to(schedule, t) == pytest.approx([expected], rel=1e-12)


@pytest.mark.parametrize(
    "t, expected",
    [
        (2, 0.001 + 0.01 * 2 / 5),
        (5, 0.011),  # end of warmup: (20 - 5) / (20 - 5) = 1
        (10, 0.001 + 0.01 * (20 - 10) / 15),
        (19, 0.001 + 0.01 * 1 / 15),
        (20, 0.001),  # decays to warmup_min_lr, not to 0
        (30, 0.001),
    ],
)
def test_warmup_decay_lr_linear(t: int, expected: float) -> None:
    opt = make_optimizer(0.5)
    schedule = WarmupDecayLR(
        opt,
        total_num_steps=20,
        warmup_min_lr=0.001,
        warmup_max_lr=0.011,
        warmup_num_steps=5,
        warmup_type="linear",
    )
    assert run_to(schedule, t) == pytest.approx([expected], rel=1e-12)


def test_warmup_decay_lr_log_warmup_and_default_max() -> None:
    opt = make_optimizer(0.5)
    schedule = WarmupDecayLR(opt, total_num_steps=100, warmup_num_steps=8)
    assert run_to(schedule, 3) == pytest.approx([0.001 * math.log(4) / math.log(8)], rel=1e-12)
    assert run_to(schedule, 54) == pytest.approx([0.001 * (100 - 54) / 92], rel=1e-12)


@pytest.mark.parametrize(
    "t, ratio",
    [
        (0, 0.2),
        (3, 0.2 + 0.8 * 3 / 5),
        (4, 0.2 + 0.8 * 4 / 5),
        (5, 0.1 + 0.9 * (1 + math.cos(math.pi * 1 / 15)) / 2),  # first decay step
        (12, 0.1 + 0.9 * (1 + math.cos(math.pi * 8 / 15)) / 2),
        (19, 0.1),  # progress (19 - 5 + 1) / 15 = 1
        (40, 0.1),  # clamped: stays at cos_min_ratio past the end
    ],
)
def test_warmup_cosine_lr_linear(t: int, ratio: float) -> None:
    opt = make_optimizer(0.1, 0.3)
    schedule = WarmupCosineLR(
        opt,
        total_num_steps=20,
        warmup_min_ratio=0.2,
        warmup_num_steps=5,
        cos_min_ratio=0.1,
        warmup_type="linear",
    )
    assert run_to(schedule, t) == pytest.approx([0.1 * ratio, 0.3 * ratio], rel=1e-12)


def test_warmup_cosine_lr_log_warmup() -> None:
    opt = make_optimizer(0.02)
    schedule = WarmupCosineLR(opt, total_num_steps=1000, warmup_num_steps=100)
    assert run_to(schedule, 49) == pytest.approx([0.02 * math.log(50) / math.log(100)], rel=1e-12)
    assert run_to(schedule, 99) == pytest.approx([0.02], rel=1e-12)
    half = 1e-4 + (1 - 1e-4) * 0.5  # progress 450 / 900 = 1/2: cos(pi/2) = 0
    assert run_to(schedule, 549) == pytest.approx([0.02 * half], rel=1e-12)


def test_warmup_num_steps_below_two_counts_as_two() -> None:
    opt = make_optimizer(0.5)
    schedule = WarmupLR(opt, 0.0, 1.0, warmup_num_steps=1, warmup_type="linear")
    assert run_to(schedule, 1) == [0.5]  # t / max(2, N) = 1 / 2
    assert run_to(schedule, 2) == [1.0]


# ---- construction, stepping and state -------------------------------------------------------


def test_construction_sets_the_starting_lr() -> None:
    opt = make_optimizer(0.5, 0.25)
    warm = WarmupLR(opt, warmup_min_lr=[0.01, 0.02], warmup_max_lr=0.1, warmup_num_steps=10)
    assert lrs_of(opt) == [0.01, 0.02] and warm.get_last_lr() == [0.01, 0.02]

    opt = make_optimizer(0.5)
    cosine = WarmupCosineLR(opt, total_num_steps=10, warmup_min_ratio=0.5, warmup_num_steps=4)
    assert lrs_of(opt) == [0.0] and cosine.get_last_lr() == [0.0]
    cosine.step()
    assert lrs_of(opt) == pytest.approx([0.25])  # the ratio applies to the lr it started from


def test_warmup_max_lr_none_takes_each_groups_lr() -> None:
    opt = make_optimizer(0.5, 0.05)
    schedule = WarmupLR(opt, warmup_num_steps=2, warmup_type="linear")
    assert lrs_of(opt) == [0.0, 0.0]
    assert run_to(schedule, 2) == [0.5, 0.05]


def test_resuming_schedule_leaves_lr_until_step() -> None:
    opt = make_optimizer(0.5)
    schedule = WarmupLR(
        opt, 0.0, 0.01, warmup_num_steps=10, warmup_type="linear", last_batch_iteration=5
    )
    assert lrs_of(opt) == [0.5]
    with pytest.raises(RuntimeError, match="step"):
        schedule.get_last_lr()
    schedule.step()
    assert lrs_of(opt) == pytest.approx([0.006])


def test_step_can_jump_to_an_iteration() -> None:
    opt = make_optimizer(0.5)
    schedule = WarmupLR(opt, 0.0, 0.01, warmup_num_steps=10, warmup_type="linear")
    schedule.step(7)
    assert schedule.last_batch_iteration == 7 and lrs_of(opt) == pytest.approx([0.007])
    schedule.step()
    assert lrs_of(opt) == pytest.approx([0.008])


@pytest.mark.parametrize(
    "make",
    [
        lambda opt: WarmupLR(opt, 0.001, 0.01, warmup_num_steps=6),
        lambda opt: WarmupDecayLR(opt, 30, 0.0, 0.01, warmup_num_steps=6, warmup_type="linear"),
        lambda opt: WarmupCosineLR(opt, 30, 0.1, warmup_num_steps=6, cos_min_ratio=0.01),
    ],
)
def test_state_dict_round_trip(make) -> None:
    first = make(make_optimizer(0.1))
    for _ in range(9):
        first.step()
    state = first.state_dict()
    assert state == {"last_batch_iteration": 8}

    second = make(make_optimizer(0.1))
    second.load_state_dict(state)
    for _ in range(25):
        first.step()
        second.step()
        assert lrs_of(second.optimizer) == lrs_of(first.optimizer)
        assert second.get_last_lr() == first.get_last_lr()


def test_tensor_lr_stays_a_tensor() -> None:
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([param], lr=torch.tensor(0.01))
    lr_tensor = opt.param_groups[0]["lr"]
    schedule = WarmupLR(opt, 0.0, 0.01, warmup_num_steps=4, warmup_type="linear")
    schedule.step()
    schedule.step()
    assert opt.param_groups[0]["lr"] is lr_tensor
    assert float(lr_tensor) == pytest.approx(0.0025)
    assert schedule.get_last_lr() == [pytest.approx(0.0025)]


def test_wrapped_optimizer_is_unwrapped() -> None:
    class Wrapper:
        def __init__(self, inner: torch.optim.Optimizer) -> None:
            self.optimizer = inner

    opt = make_optimizer(0.5)
    WarmupLR(Wrapper(opt), warmup_min_lr=0.003)
    assert lrs_of(opt) == [0.003]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"warmup_num_steps": 0}, "warmup_num_steps"),
        ({"warmup_num_steps": 2.5}, "warmup_num_steps"),
        ({"warmup_type": "cosine"}, "warmup_type"),
        ({"warmup_min_lr": [0.0, 0.1, 0.2]}, "warmup_min_lr: expected 2 values"),
    ],
)
def test_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        WarmupLR(make_optimizer(0.1, 0.2), **kwargs)


def test_not_an_optimizer() -> None:
    with pytest.raises(TypeError, match="not a torch.optim.Optimizer"):
        WarmupLR(object())


# ---- from the config ----------------------------------------------------------------------------


def test_build_from_config() -> None:
    base = {"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"lr": 0.02}}}
    assert build_lr_scheduler(load_config(base).scheduler, make_optimizer(0.02)) is None

    cfg = load_config(
        {
            **base,
            "scheduler": {
                "type": "WarmupDecayLR",
                "params": {"total_num_steps": 1e2, "warmup_max_lr": 0.04, "warmup_num_steps": 10},
            },
        }
    )
    opt = make_optimizer(0.02)
    schedule = build_lr_scheduler(cfg.scheduler, opt)
    assert isinstance(schedule, WarmupDecayLR)
    assert (schedule.total_num_steps, schedule.warmup_num_steps, schedule.max_lrs) == (
        100,
        10,
        [0.04],
    )

    cfg = load_config(
        {**base, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}}}
    )
    schedule = build_lr_scheduler(cfg.scheduler, opt := make_optimizer(0.02))
    assert isinstance(schedule, WarmupLR) and schedule.max_lrs == [0.02]  # the optimizer's lr
    assert lrs_of(opt) == [0.0]


# ---- against DeepSpeed itself, where it is installed ----------------------------------------------


def test_matches_deepspeed_when_installed() -> None:
    try:
        from deepspeed.runtime import lr_schedules as ds
    except Exception:  # any failure to import means there is nothing to compare against
        pytest.skip("deepspeed is not importable")
    cases = [
        ("WarmupLR", {"warmup_min_lr": [0.0, 0.001], "warmup_num_steps": 7}),
        ("WarmupLR", {"warmup_max_lr": 0.02, "warmup_num_steps": 5, "warmup_type": "linear"}),
        ("WarmupDecayLR", {"total_num_steps": 25, "warmup_max_lr": 0.02, "warmup_num_steps": 6}),
        ("WarmupCosineLR", {"total_num_steps": 25, "warmup_min_ratio": 0.1, "warmup_num_steps": 6}),
        ("WarmupCosineLR", {"total_num_steps": 4, "warmup_num_steps": 6, "warmup_type": "linear"}),
    ]
    ours = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR}
    for name, kwargs in cases:
        opt_ds, opt_ours = make_optimizer(0.01, 0.03), make_optimizer(0.01, 0.03)
        reference, schedule = getattr(ds, name)(opt_ds, **kwargs), ours[name](opt_ours, **kwargs)
        for _ in range(40):
            assert lrs_of(opt_ours) == lrs_of(opt_ds), (name, kwargs)
            reference.step()
            schedule.step()
