"""Bad input: every refused checkpoint names the file and the tensor (or key), and a refused load
leaves the engine exactly as it was (everything is validated before anything is applied)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import build, snapshot, train
from parity import Tiny

import zero_offload
from zero_offload.checkpoint import CheckpointError, CheckpointNotFoundError
from zero_offload.checkpoint.format import sealed_meta_bytes
from zero_offload.checkpoint.read.reader import CheckpointReader
from zero_offload.checkpoint.tensor_file import read_header

CASE = {"id": "errors", "stage": 2, "offload": True, "dtype": "fp32", "micro": 2, "gas": 1}
TAG = "global_step2"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("saved")
    engine, _ = build(CASE)
    train(engine, CASE, 0, 2)
    engine.save_checkpoint(str(root))
    engine.destroy()
    return root


@pytest.fixture
def ckpt(saved, tmp_path) -> Path:
    """A private copy of the saved checkpoint, free to damage."""
    shutil.copytree(saved, tmp_path / "ck")
    return tmp_path / "ck"


@pytest.fixture
def fresh():
    """An engine that has trained one step (so a partial load would show)."""
    engine, model = build(CASE)
    train(engine, CASE, 0, 1)
    yield engine, model
    engine.destroy()


def _refused(engine, model, load_dir, match: str, exc=CheckpointError, **kw) -> None:
    before = snapshot(engine, model)
    so = engine.opt_groups[0].optimizer
    state_before = (
        so.exp_avg.clone(),
        so.exp_avg_sq.clone(),
        so.step_count,
        dict(engine.opt_groups[0].flat.hyper),
    )
    with pytest.raises(exc, match=match):
        engine.load_checkpoint(str(load_dir), **kw)
    after = snapshot(engine, model)
    for part in ("master", "module"):
        for k, v in before[part].items():
            assert torch.equal(after[part][k], v), f"partial load: {part} {k} changed"
    assert after["counters"] == before["counters"] and after["lr"] == before["lr"]
    assert torch.equal(so.exp_avg, state_before[0]) and torch.equal(so.exp_avg_sq, state_before[1])
    assert so.step_count == state_before[2]


def test_missing_latest_loads_nothing(tmp_path, fresh, caplog):
    engine, _ = fresh
    with caplog.at_level(logging.WARNING, logger="zero_offload"):
        assert engine.load_checkpoint(str(tmp_path)) == (None, None)
        assert engine.load_checkpoint(str(tmp_path / "never-created")) == (None, None)
    assert "latest" in caplog.text


def test_missing_tag_names_path(ckpt, fresh):
    _refused(
        *fresh,
        ckpt,
        r"tag 'global_step9' not found: .*ck/global_step9",
        CheckpointNotFoundError,
        tag="global_step9",
    )


def test_latest_naming_missing_tag(ckpt, fresh):
    (ckpt / "latest").write_text("gone")
    _refused(*fresh, ckpt, r"tag 'gone' not found", CheckpointNotFoundError)


def test_missing_shard_file(ckpt, fresh):
    (ckpt / TAG / "rank_00000.safetensors").unlink()
    _refused(*fresh, ckpt, r"rank_00000\.safetensors: file is missing", CheckpointNotFoundError)


def test_truncated_shard(ckpt, fresh):
    path = ckpt / TAG / "rank_00000.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    _refused(
        *fresh, ckpt, r"rank_00000\.safetensors: \d+ bytes, the checkpoint recorded \d+ \(truncated"
    )


def test_checksum_mismatch_names_file_and_tensor(ckpt, fresh):
    path = ckpt / TAG / "rank_00000.safetensors"
    header = read_header(path)
    pos = header.data_start + header.tensors["group0.exp_avg_sq"].begin + 12
    data = bytearray(path.read_bytes())
    data[pos] ^= 0x40
    path.write_bytes(bytes(data))
    _refused(*fresh, ckpt, r"rank_00000\.safetensors: checksum mismatch .*group0\.exp_avg_sq")


def test_damaged_model_file(ckpt, fresh):
    path = ckpt / TAG / "model.safetensors"
    header = read_header(path)
    data = bytearray(path.read_bytes())
    data[header.data_start + header.tensors["frozen.weight"].begin] ^= 1
    path.write_bytes(bytes(data))
    _refused(*fresh, ckpt, r"model\.safetensors: checksum mismatch .*frozen\.weight")


def test_corrupt_meta_json(ckpt, fresh):
    (ckpt / TAG / "meta.json").write_text('{"format": "zero_offload.checkpoint", ')
    _refused(*fresh, ckpt, r"meta\.json: not valid JSON")


def test_unknown_format_version(ckpt, fresh):
    meta_path = ckpt / TAG / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["format_version"] = 99
    meta_path.write_text(json.dumps(meta))
    _refused(*fresh, ckpt, r"format_version 99 is not supported")


class Renamed(Tiny):
    def __init__(self) -> None:
        super().__init__()
        self.l3 = self.l2  # same module under another name: the state dict keys change
        del self.l2

    def forward(self, x, y):  # never called
        raise NotImplementedError


class Reshaped(Tiny):
    def __init__(self) -> None:
        super().__init__()
        self.unused = torch.nn.Linear(3, 4)


def _engine_for(model):
    from checkpoint_helpers import case_config

    engine, _, _, _ = zero_offload.initialize(model=model, config=case_config(CASE))
    return engine


def test_model_with_other_names(ckpt):
    torch.manual_seed(0)
    model = Renamed()
    engine = _engine_for(model)
    _refused(
        engine,
        model,
        ckpt,
        r"model\.safetensors: state dict keys differ: the model has \['l3\.weight'",
    )


def test_model_with_other_shapes(ckpt):
    torch.manual_seed(0)
    model = Reshaped()
    engine = _engine_for(model)
    _refused(
        engine,
        model,
        ckpt,
        r"model\.safetensors: tensor 'unused\.weight' has shape \[3, 3\], the model's is \[4, 3\]",
    )


def test_param_groups_differ(ckpt, fresh):
    engine, model = fresh
    meta_path = ckpt / TAG / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["groups"][0]["names"][0] = "renamed.bias"
    meta_path.write_bytes(sealed_meta_bytes(meta))  # re-sealed: reach the layout check
    _refused(
        engine,
        model,
        ckpt,
        r"param group 0 differs at position 0: the checkpoint has 'renamed\.bias'",
    )


def test_non_json_client_state_is_refused_before_writing(tmp_path, fresh):
    engine, _ = fresh
    with pytest.raises(
        CheckpointError,
        match=r"client_state\['step'\]: value of type Tensor is not JSON-serializable",
    ):
        engine.save_checkpoint(str(tmp_path), client_state={"ok": 1, "step": torch.tensor(3)})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("tag", ["../up", ".hidden", "latest", ""])
def test_bad_tag(tmp_path, fresh, tag):
    engine, _ = fresh
    with pytest.raises(CheckpointError, match="tag"):
        engine.save_checkpoint(str(tmp_path), tag=tag)
    assert list(tmp_path.iterdir()) == []


def test_export_of_damaged_checkpoint_names_file(ckpt):
    from zero_offload.checkpoint import get_fp32_state_dict_from_zero_checkpoint

    path = ckpt / TAG / "rank_00000.safetensors"
    header = read_header(path)
    data = bytearray(path.read_bytes())
    data[header.data_start + header.tensors["group0.master"].begin + 4] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(
        CheckpointError, match=r"rank_00000\.safetensors: checksum mismatch .*group0\.master"
    ):
        get_fp32_state_dict_from_zero_checkpoint(str(ckpt))


def test_reader_rejects_non_checkpoint(tmp_path):
    (tmp_path / "meta.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(CheckpointError, match="not a zero_offload checkpoint"):
        CheckpointReader.open(tmp_path, None)
