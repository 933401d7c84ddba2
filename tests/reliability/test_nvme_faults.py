"""Issue 31, item 2: NVMe state that cannot be trusted is caught. Swap contents changed
underneath the run (another process, a bad disk) fail the read with an error naming the file;
a param swap file removed, truncated or replaced mid-run is an ``NvmeSwapError``; and
``save_checkpoint`` refuses non-finite master weights or moments, naming the params, so a
checkpoint never preserves poisoned state as if it were good."""

from __future__ import annotations

import contextlib
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from test_nvme_offload import _engine, _train

from zero_offload.checkpoint import CheckpointError
from zero_offload.nvme.errors import NvmeSwapError


def _destroy(engine) -> None:
    """Handing the params back reads the damaged file too: that fails the same way."""
    with contextlib.suppress(NvmeSwapError):
        engine.destroy()


def _overwrite(path: Path, offset: int, data: bytes) -> None:
    """Another process writing into the file (buffered I/O, as a stray tool would)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def test_an_overwritten_optimizer_record_is_caught_not_trained_on(tmp_path):
    engine = _engine(tmp_path / "swap")
    _train(engine, range(1))
    state = engine.opt_groups[0].optimizer.state
    committed = state._offset(0, state.current[0])  # chunk 0's master, as the next step reads it
    _overwrite(state.file.path, committed, struct.pack("<4f", *[float("inf")] * 4))
    with pytest.raises(NvmeSwapError, match="checksum mismatch") as err:
        _train(engine, range(1, 2))
    assert str(state.file.path) in str(err.value) and "master" in str(err.value)
    with pytest.raises(NvmeSwapError, match="checksum mismatch"):  # and never checkpointed
        engine.save_checkpoint(tmp_path / "ck")
    assert not (tmp_path / "ck" / "latest").exists()
    engine.destroy()


def test_an_overwritten_param_block_is_caught(tmp_path):
    engine = _engine(tmp_path / "swap", "nvme", "nvme")
    _train(engine, range(1))
    shard = engine.param_store.swapped[0]
    shard.drop_cached()  # the next fetch reads the file
    _overwrite(shard.file.path, 0, b"\x7f" * 64)
    with pytest.raises(NvmeSwapError, match="param-shard .*checksum mismatch"):
        _train(engine, range(1, 2))
    _destroy(engine)


@pytest.mark.parametrize("how", ["unlinked", "truncated", "replaced"])
def test_a_param_swap_file_changed_under_the_run_is_named(tmp_path, how):
    engine = _engine(tmp_path / "swap", "cpu", "nvme")
    _train(engine, range(1))
    shard = engine.param_store.swapped[0]
    path = shard.file.path
    if how == "unlinked":
        path.unlink()
    elif how == "truncated":
        os.truncate(path, 4096)
    else:  # a copy put in its place: the same bytes, another file
        shutil.copyfile(path, tmp_path / "copy")
        os.replace(tmp_path / "copy", path)
    shard.drop_cached()  # the next fetch reads the file
    with pytest.raises(NvmeSwapError, match=f"{path}: the param-shard swap file was"):
        _train(engine, range(1, 2))
    _destroy(engine)


def test_a_replaced_optimizer_swap_file_is_named(tmp_path):
    engine = _engine(tmp_path / "swap")
    _train(engine, range(1))
    path = engine.opt_groups[0].optimizer.state.file.path
    shutil.copyfile(path, tmp_path / "copy")
    os.replace(tmp_path / "copy", path)
    with pytest.raises(NvmeSwapError, match="optimizer-state swap file was removed"):
        _train(engine, range(1, 2))
    engine.destroy()


@pytest.mark.parametrize("where", ["cpu", "nvme"])
@pytest.mark.parametrize("kind", ["master", "exp_avg_sq"])
def test_save_refuses_non_finite_state_naming_the_param(tmp_path, where, kind):
    engine = _engine(tmp_path / "swap", where)
    _train(engine, range(1))
    engine.save_checkpoint(tmp_path / "ck", tag="good")
    so = engine.opt_groups[0].optimizer
    at = so.state.numel - 3  # near the end of the shard: the last param of the group
    if where == "nvme":
        so.state.write(kind, at, torch.tensor([float("nan")]))
    else:
        getattr(so.state, kind)[at] = float("inf")
    with pytest.raises(
        CheckpointError, match=f"refused: .*{kind if kind != 'master' else 'master'}"
    ) as err:
        engine.save_checkpoint(tmp_path / "ck", tag="poisoned")
    assert repr(so.group.names[-1]) in str(err.value), err.value
    assert not (tmp_path / "ck" / "poisoned").exists()
    assert (tmp_path / "ck" / "latest").read_text() == "good"
    engine.destroy()
