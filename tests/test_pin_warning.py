"""Offload on CUDA from pageable memory warns once, naming the key; the CPU path never warns.
The device is simulated: only its type is read."""

from __future__ import annotations

import warnings

import pytest
import torch

from zero_offload.config import load_config
from zero_offload.runtime.engine import pin_warning


def _zc(optimizer: dict | None, param: dict | None):
    zc: dict = {"stage": 3}
    if optimizer is not None:
        zc["offload_optimizer"] = optimizer
    if param is not None:
        zc["offload_param"] = param
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zc}
    return load_config(cfg).zero_optimization


@pytest.mark.parametrize(
    "optimizer,param,keys",
    [
        ({"device": "cpu", "pin_memory": False}, None, ["offload_optimizer"]),
        (None, {"device": "cpu", "pin_memory": False}, ["offload_param"]),
        ({"device": "cpu", "pin_memory": True}, {"device": "cpu"}, []),
        ({"device": "none", "pin_memory": False}, None, []),  # nothing on the host
        (None, None, []),
    ],
)
def test_unpinned_keys(optimizer, param, keys):
    got = pin_warning.unpinned_keys(_zc(optimizer, param))
    assert got == [f"zero_optimization.{k}.pin_memory" for k in keys]


def test_warns_once_on_cuda_only(monkeypatch):
    monkeypatch.setattr(pin_warning, "_warned", False)
    keys = ["zero_optimization.offload_optimizer.pin_memory"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not pin_warning.warn_unpinned(torch.device("cpu"), keys)
        assert pin_warning.warn_unpinned(torch.device("cuda", 0), keys)
        assert not pin_warning.warn_unpinned(torch.device("cuda", 0), keys)  # once
    assert len(caught) == 1
    assert "offload_optimizer.pin_memory" in str(caught[0].message)


def test_no_warning_when_pinned(monkeypatch):
    monkeypatch.setattr(pin_warning, "_warned", False)
    assert not pin_warning.warn_unpinned(torch.device("cuda", 0), [])
