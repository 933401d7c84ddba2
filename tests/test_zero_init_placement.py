"""``zero.Init`` reads ``offload_param`` from the config when the caller names no remote device
(DeepSpeed's ``Init.remote_device``/``pin_memory``), with the accelerator simulated: the CPU
cannot show where CUDA memory goes, but it shows which device a config resolves to."""

from __future__ import annotations

import pytest
import torch

import zero_offload.zero as zero
from zero_offload.core import dist
from zero_offload.zero import init_placement

CUDA0 = torch.device("cuda", 0)  # a device value only: nothing is allocated on it


def _config(offload_param: dict | None) -> dict:
    zc: dict = {"stage": 3}
    if offload_param is not None:
        zc["offload_param"] = offload_param
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zc}


@pytest.fixture
def simulated_cuda(monkeypatch):
    """``dist.default_device()`` answers cuda:0 as it would on a GPU machine."""
    monkeypatch.setattr(dist, "default_device", lambda: CUDA0)


@pytest.mark.parametrize(
    "offload,remote,pin",
    [
        ({"device": "cpu"}, "cpu", True),  # offload_param's pin_memory defaults to true
        ({"device": "cpu", "pin_memory": False}, "cpu", False),
        ({"device": "nvme"}, "nvme", True),
    ],
)
def test_config_offload_param_puts_chunks_on_host(simulated_cuda, tmp_path, offload, remote, pin):
    if offload["device"] == "nvme":
        offload = {**offload, "nvme_path": str(tmp_path)}
    init = zero.Init(config_dict_or_path=_config(offload))
    assert init.remote_device == remote
    assert init.shard_device == torch.device("cpu")
    assert init.pin is pin and init.pin_memory is pin


@pytest.mark.parametrize("offload", [None, {"device": "none"}])
def test_no_offload_param_keeps_chunks_on_the_accelerator(simulated_cuda, offload):
    init = zero.Init(config_dict_or_path=_config(offload), pin_memory=True)
    assert init.remote_device == "cuda"
    assert init.shard_device == CUDA0
    assert init.pin is False  # pinning is for host chunks only


def test_explicit_remote_device_wins_over_the_config(simulated_cuda):
    init = zero.Init(config_dict_or_path=_config({"device": "cpu"}), remote_device="cuda")
    assert init.shard_device == CUDA0
    init = zero.Init(remote_device="nvme")  # "nvme" chunks wait on the host for initialize()
    assert init.shard_device == torch.device("cpu")


def test_resolve_without_config():
    got = init_placement.resolve(None, True, None, CUDA0)
    assert got == init_placement.InitPlacement("cuda", CUDA0, False)
    got = init_placement.resolve("cpu", True, None, CUDA0)
    assert got == init_placement.InitPlacement("cpu", torch.device("cpu"), True)


def test_config_only_init_builds_host_chunks():
    """The real path on this machine: every chunk on the host, values as without Init."""
    torch.manual_seed(0)
    ref = torch.nn.Linear(8, 6)
    torch.manual_seed(0)
    with zero.Init(config_dict_or_path=_config({"device": "cpu"})):
        model = torch.nn.Linear(8, 6)
    assert all(p.numel() == 0 and p.ds_tensor.device.type == "cpu" for p in model.parameters())
    with zero.GatheredParameters(list(model.parameters())):
        assert torch.equal(model.weight, ref.weight)
        assert torch.equal(model.bias, ref.bias)
