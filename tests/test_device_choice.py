"""``ZERO_OFFLOAD_DEVICE=cpu`` on a machine with a GPU: the engine, the default backend and the
launcher all take the CPU (gloo, no GPU count), as on a machine without one."""

from __future__ import annotations

import pytest
import torch

from zero_offload.core import dist


@pytest.fixture
def gpu_machine(monkeypatch):
    """A machine that reports 2 CUDA devices (no CUDA call is made past these)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda *a: None)
    backends = []
    monkeypatch.setattr(
        torch.distributed, "init_process_group", lambda backend, **kw: backends.append(backend)
    )
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(dist.atexit, "register", lambda fn: None)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    return backends


def test_cpu_forced_on_a_gpu_machine(gpu_machine, monkeypatch):
    monkeypatch.setenv("ZERO_OFFLOAD_DEVICE", "cpu")
    assert not dist.uses_cuda()
    assert dist.default_device() == torch.device("cpu")
    dist.init_distributed()
    assert gpu_machine == ["gloo"]


def test_gpu_machine_defaults_to_cuda_and_nccl(gpu_machine, monkeypatch):
    monkeypatch.delenv("ZERO_OFFLOAD_DEVICE", raising=False)
    assert dist.uses_cuda()
    dist.init_distributed()
    assert gpu_machine == ["nccl"]


def test_launcher_counts_no_gpus_when_cpu_is_forced(gpu_machine, monkeypatch):
    """With the CPU forced, asking for more ranks than GPUs is allowed (they are CPU ranks)."""
    import argparse

    from zero_offload.cli.launch import command as launch

    parser = argparse.ArgumentParser()
    launch.add_arguments(parser)
    seen = {}

    def fake_argv(args, cuda_devices):
        seen["cuda_devices"] = cuda_devices
        raise ValueError("stop here")

    monkeypatch.setattr(launch, "torchrun_argv", fake_argv)
    monkeypatch.setenv("ZERO_OFFLOAD_DEVICE", "cpu")
    assert launch.run(parser.parse_args(["--num_gpus", "4", "x.py"])) == 2
    assert seen["cuda_devices"] == 0
    monkeypatch.delenv("ZERO_OFFLOAD_DEVICE")
    launch.run(parser.parse_args(["--num_gpus", "4", "x.py"]))
    assert seen["cuda_devices"] == 2


def test_nccl_group_is_bound_to_the_rank_device(monkeypatch):
    """NCCL: ``device_id`` is this rank's GPU (eager communicator, no guessed device); gloo
    gets none. The timeout is passed either way."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(
        torch.distributed, "init_process_group", lambda **kw: calls.append(("init", kw))
    )
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(dist.atexit, "register", lambda fn: None)
    monkeypatch.delenv("ZERO_OFFLOAD_DEVICE", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("LOCAL_RANK", "2")
    dist.init_distributed(timeout=7)
    gpu = torch.device("cuda", 2)
    assert calls[0] == ("set_device", gpu)
    init = calls[1][1]
    assert init["backend"] == "nccl" and init["device_id"] == gpu
    assert init["timeout"].total_seconds() == 7
    calls.clear()
    dist.init_distributed(dist_backend="gloo")
    assert "device_id" not in calls[-1][1]
