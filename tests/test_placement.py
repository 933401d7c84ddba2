"""Placement from the config: where the optimizer state and the param shard live, the update
chunk, and the delayed update, read once."""

import torch

from zero_offload.config import load_config
from zero_offload.runtime.update.placement import MAX_CHUNK, Placement, update_chunk


def _placement(zero: dict, tmp_path) -> Placement:
    config = load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero})
    return Placement.from_config(config, torch.device("cpu"), 3, "run")


def test_device_host_nvme(tmp_path):
    p = _placement({"stage": 2}, tmp_path)
    assert (p.optimizer, p.params, p.host_update, p.delayed, p.nvme) == (
        "device",
        "device",
        False,
        False,
        None,
    )
    p = _placement({"stage": 2, "offload_optimizer": {"device": "cpu"}}, tmp_path)
    assert (p.optimizer, p.host_update, p.delayed) == ("host", True, False)
    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    p = _placement({"stage": 3, "offload_optimizer": nvme, "offload_param": nvme}, tmp_path)
    assert (p.optimizer, p.params) == ("nvme", "nvme")
    assert (
        p.nvme.optimizer_dir == tmp_path / "zero_offload_swap" / "run" / "rank00003" / "optimizer"
    )


def test_delayed_update_is_part_of_the_placement(tmp_path):
    off = {"device": "cpu", "delayed_update": True, "delayed_update_after": 5}
    p = _placement({"stage": 2, "offload_optimizer": off}, tmp_path)
    assert p.delayed and p.delayed_after == 5


def test_update_chunk_is_aligned_and_bounded():
    assert update_chunk(10**9) == MAX_CHUNK
    assert update_chunk(5000) == 4096 and update_chunk(1) == 2048
