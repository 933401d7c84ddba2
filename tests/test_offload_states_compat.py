"""DeepSpeed's names for the offload API and configs (``deepspeed.runtime.zero.offload_config``,
``deepspeed.runtime.zero.offload_states``): the project's own enums and config models, with the
same validation as inside a config file."""

from __future__ import annotations

import pytest
import torch
from parity import engine_config, global_step, make_model
from pydantic import ValidationError


def test_offload_config_models_are_the_projects():
    from zero_offload.config.zero.zero_optimization import (
        OffloadOptimizerConfig,
        OffloadParamConfig,
    )
    from zero_offload.deepspeed_compat.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig as Opt,
    )
    from zero_offload.deepspeed_compat.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadParamConfig as Param,
    )
    from zero_offload.deepspeed_compat.runtime.zero.offload_config import OffloadDeviceEnum

    assert issubclass(Opt, OffloadOptimizerConfig) and issubclass(Param, OffloadParamConfig)
    config = Opt(**{"ratio": 0.3})  # DeepSpeed's test_zero_offloadpp
    assert config.ratio == 0.3 and config.device == "none" and config.pipeline is False
    assert Opt(pipeline_write=True).pipeline is True
    assert Opt(device=OffloadDeviceEnum.cpu).device == OffloadDeviceEnum.cpu == "cpu"
    assert Param(device="cpu", pin_memory=False).pin_memory is False
    with pytest.raises(ValidationError, match="ratio"):
        Opt(ratio=1.5)
    with pytest.raises(ValidationError, match=r'allowed: "none", "cpu", "nvme"; got "gpu"'):
        Param(device="gpu")
    with pytest.raises(ValidationError, match=r"required with device .nvme."):
        Opt(device="nvme")  # the same rule as in a config file


def test_enums_and_get_state_devices():
    import zero_offload
    from zero_offload.deepspeed_compat.runtime.zero.offload_config import (
        OffloadDeviceEnum,
        OffloadStateTypeEnum,
    )
    from zero_offload.deepspeed_compat.runtime.zero.offload_states import get_state_devices

    assert [s.value for s in OffloadStateTypeEnum] == [
        "optim_states",
        "hp_params",
        "lp_params",
        "lp_grads",
        "contiguous_grad_buffer",
    ]
    assert [d.value for d in OffloadDeviceEnum] == ["none", "cpu", "nvme"]
    cfg = engine_config(2, False, 1, 2, 0.0, True, "bf16", 100)
    engine, *_ = zero_offload.initialize(model=make_model(), config=cfg)
    x = torch.randint(0, 32, (2, 5))
    global_step(engine, x, x)
    cpu = torch.device("cpu")
    engine.offload_states(include=[OffloadStateTypeEnum.optim_states], device=OffloadDeviceEnum.cpu)
    assert get_state_devices(engine, OffloadStateTypeEnum.optim_states) == {cpu}
    assert get_state_devices(engine, OffloadStateTypeEnum.lp_params) == {engine.device}
    engine.offload_states()
    assert get_state_devices(engine, OffloadStateTypeEnum.contiguous_grad_buffer) == set()
    engine.reload_states()
    assert get_state_devices(engine, OffloadStateTypeEnum.hp_params) == {engine.device}


def test_accelerator_memory_counters(monkeypatch):
    """DeepSpeed's tests read get_accelerator().memory_allocated() around offload_states: on
    the CPU the process's resident bytes (DeepSpeed's CPU accelerator), peaks since a reset.
    The resident size is driven here (a real one moves with the allocator's page reuse)."""
    from zero_offload.deepspeed_compat.accelerator import get_accelerator, memory

    assert memory._rss() > 0  # /proc/self/statm read
    acc = get_accelerator()
    rss = [100 << 20]
    monkeypatch.setattr(memory, "_rss", lambda: rss[0])
    acc.reset_peak_memory_stats()
    assert acc.memory_allocated() == acc.memory_reserved() == 100 << 20
    rss[0] = 300 << 20
    assert acc.memory_allocated() == 300 << 20
    rss[0] = 200 << 20
    assert acc.memory_allocated() == 200 << 20
    assert acc.max_memory_allocated() == acc.max_memory_reserved() == 300 << 20
    acc.reset_max_memory_allocated()
    assert acc.max_memory_allocated() == 200 << 20


def test_get_state_devices_with_offload_optimizer():
    """DeepSpeed's stage 3 with offload_optimizer: master, moments and the reduced gradients
    are in host memory, where offload_states leaves them; the params come and go."""
    import zero_offload
    from zero_offload.deepspeed_compat.runtime.zero.offload_config import (
        OffloadStateTypeEnum as S,
    )
    from zero_offload.deepspeed_compat.runtime.zero.offload_states import get_state_devices

    zero = {"stage3_param_persistence_threshold": 0}
    cfg = engine_config(3, True, 1, 2, 0.0, True, "bf16", 100, zero_extra=zero)
    engine, *_ = zero_offload.initialize(model=make_model(), config=cfg)
    x = torch.randint(0, 32, (2, 5))
    global_step(engine, x, x)
    cpu = torch.device("cpu")
    engine.offload_states(include=[S.optim_states, S.hp_params, S.lp_grads])
    assert engine.offloaded_states() == set()  # all three were on the host already
    for state in (S.optim_states, S.hp_params, S.lp_grads):
        assert get_state_devices(engine, state) == {cpu}
    engine.offload_states()
    assert S.lp_params in engine.offloaded_states()
    engine.reload_states()


def test_the_optimizer_answers_for_the_engine():
    """RLHF trainers call DeepSpeed's ZeRO optimizer's offload_states/reload_states."""
    import zero_offload

    engine, optimizer, *_ = zero_offload.initialize(
        model=make_model(), config=engine_config(1, False, 1, 2, 0.0, True, "bf16", 100)
    )
    optimizer.offload_states(include=["optim_states"], non_blocking=True)
    assert {s.value for s in engine.offloaded_states()} == {"optim_states"}
    optimizer.reload_states()
    assert engine.offloaded_states() == set()
