"""GPU probe: a config-only ``zero.Init`` with ``offload_param`` builds a model whose 16-bit
params do not fit the device. The device is made small with
``set_per_process_memory_fraction``; every chunk must land in pinned host memory and the device
hold at most about one param while building (it is broadcast from the device one at a time)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MIB = 1 << 20
LAYERS, WIDTH = 12, 4096  # 12 x 16M params: 384 MiB at bf16, 768 MiB at fp32
DEVICE_CAP = 256 * MIB  # the "small" device: less than the 16-bit model


@pytest.fixture
def small_device():
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(DEVICE_CAP / total)
    yield
    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.empty_cache()


def test_config_only_init_keeps_chunks_on_the_host(small_device):
    import zero_offload.zero as zero

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
    }
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    init = zero.Init(config_dict_or_path=config)
    assert init.remote_device == "cpu" and init.pin_memory
    with init:
        model = torch.nn.Sequential(
            *[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)]
        )
    params = list(model.parameters())
    assert all(p.numel() == 0 for p in params)
    assert all(p.ds_tensor.device.type == "cpu" and p.ds_tensor.is_pinned() for p in params)
    assert all(p.ds_tensor.dtype == torch.bfloat16 for p in params)
    one_param_fp32 = WIDTH * WIDTH * 4
    assert torch.cuda.memory_allocated() - base < 8 * MIB  # nothing of the model stays
    assert torch.cuda.max_memory_allocated() - base <= 2 * one_param_fp32
    with zero.GatheredParameters([params[0]]):
        assert params[0].shape == (WIDTH, WIDTH) and bool(params[0].isfinite().all())
