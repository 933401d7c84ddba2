"""Issue: an ``nvme_path`` that is a symlink loop raised a raw ``RuntimeError: Symlink loop``
naming the path but not the config key."""

from __future__ import annotations

import os

import pytest
import reliability_helpers as h

import zero_offload
from zero_offload.config import ConfigError
from zero_offload.nvme.preflight import check_nvme_path


def _loop(tmp_path) -> str:
    a, b = tmp_path / "a", tmp_path / "b"
    os.symlink(b, a)
    os.symlink(a, b)
    return str(a / "swap")


def test_symlink_loop_is_named_by_key(tmp_path):
    key = "zero_optimization.offload_optimizer.nvme_path"
    with pytest.raises(ConfigError, match=rf"{key}: .*symlink loop"):
        check_nvme_path(key, _loop(tmp_path), 0)


def test_symlink_loop_at_initialize_names_the_key(tmp_path):
    cfg = h.config(1)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": _loop(tmp_path)}
    with pytest.raises(ConfigError, match=r"offload_optimizer\.nvme_path.*symlink loop"):
        zero_offload.initialize(model=h.net(), config=cfg)
