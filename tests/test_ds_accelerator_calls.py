"""``deepspeed.accelerator.get_accelerator()``'s calls that DeepSpeed scripts make on every
rank: ``set_device``, the seed and RNG-state calls (torch's generator of the engine's device)
and ``supported_dtypes`` (each dtype listed trains)."""

from __future__ import annotations

import pytest
import torch

from zero_offload import deepspeed_compat as deepspeed


def _rand(acc) -> torch.Tensor:
    return torch.rand(3, device=acc.current_device_name())


def test_seed_and_rng_state_are_torchs() -> None:
    acc = deepspeed.get_accelerator()
    acc.set_device(0)  # the CPU has one device; CUDA's device 0 otherwise
    acc.manual_seed(1234)
    state = acc.get_rng_state()
    first = _rand(acc)
    acc.set_rng_state(state)
    assert torch.equal(first, _rand(acc))
    acc.manual_seed_all(7)
    assert acc.initial_seed() == 7


def test_supported_dtypes_train() -> None:
    acc = deepspeed.get_accelerator()
    dtypes = acc.supported_dtypes()
    assert dtypes[0] == torch.float and len(set(dtypes)) == len(dtypes)
    for dtype in dtypes:
        block = {
            torch.bfloat16: {"bf16": {"enabled": True}},
            torch.float16: {"fp16": {"enabled": True}},
        }
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        }
        config.update(block.get(dtype, {}))
        torch.manual_seed(0)
        engine = deepspeed.initialize(model=torch.nn.Linear(4, 2), config=config)[0]
        x = torch.ones(2, 4, dtype=dtype, device=engine.device)
        engine.backward(engine(x).float().sum())
        engine.step()
        assert next(engine.module.parameters()).dtype == dtype
        engine.destroy()


def test_cpu_device_count_is_one_per_local_rank(monkeypatch) -> None:
    """DeepSpeed's CPU accelerator counts one device per local rank, so a script's
    ``world_size <= device_count()`` check holds on a CPU job."""
    acc = deepspeed.get_accelerator()
    if acc.device_name() != "cpu":
        pytest.skip("the CPU accelerator's count")
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert acc.device_count() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # torchrun
    assert acc.device_count() == 3
    monkeypatch.setenv("LOCAL_SIZE", "2")  # DeepSpeed's launcher
    assert acc.device_count() == 2
