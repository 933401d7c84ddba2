"""Consolidated export (API and CLI), the 16-bit model file, tied weights, and the partial loads
(``load_module_only``, ``load_optimizer_states=False``), on one rank in this process."""

from __future__ import annotations

import pytest
import torch
from checkpoint_helpers import TiedTiny, build, snapshot, train
from safetensors.torch import load_file

from zero_offload.checkpoint import get_fp32_state_dict_from_zero_checkpoint
from zero_offload.checkpoint.tensor_file import read_header
from zero_offload.cli.main import main as cli

TIED = {
    "id": "tied",
    "tied": True,
    "stage": 1,
    "offload": False,
    "dtype": "fp32",
    "micro": 2,
    "gas": 1,
}
TAG = "global_step2"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("tied")
    engine, model = build(TIED)
    train(engine, TIED, 0, 2)
    state = snapshot(engine, model)
    engine.save_checkpoint(str(root))
    engine.destroy()
    return root, state


def test_tied_weight_stored_once_and_exported_under_both_names(saved):
    root, state = saved
    header = read_header(root / TAG / "model.safetensors")
    assert "emb.weight" in header.tensors and "head.weight" not in header.tensors
    sd = get_fp32_state_dict_from_zero_checkpoint(str(root))
    assert list(sd) == list(TiedTiny().state_dict())
    assert sd["head.weight"] is sd["emb.weight"]
    for name, master in state["master"].items():
        assert torch.equal(sd[name], master), name
    assert (
        sd["calls"].dtype == torch.int64 and int(sd["calls"]) == 2
    )  # buffers as saved: 2 forwards
    assert torch.equal(sd["frozen.weight"], state["module"]["frozen.weight"])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cli_export_loads_strictly_into_a_fresh_model(saved, tmp_path, dtype):
    root, state = saved
    assert cli(["export", str(root), str(tmp_path / "out"), "--dtype", dtype]) == 0
    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    want = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    assert tensors["emb.weight"].dtype == want and tensors["calls"].dtype == torch.int64
    model = TiedTiny()
    model.load_state_dict(tensors, strict=True)
    for name, master in state["master"].items():
        got = dict(model.named_parameters())[name]
        assert torch.equal(got.detach(), master.to(want).float()), name


def test_cli_export_reports_missing_checkpoint(tmp_path, capsys):
    assert cli(["export", str(tmp_path), str(tmp_path / "out"), "--tag", "nope"]) == 1
    assert "tag 'nope' not found" in capsys.readouterr().err


def test_resume_restores_tied_weights_and_buffers(saved):
    root, state = saved
    engine, model = build(TIED)
    engine.load_checkpoint(str(root))
    got = snapshot(engine, model)
    for k, v in state["module"].items():
        assert torch.equal(got["module"][k], v), k
    assert model.head.weight is model.emb.weight
    engine.destroy()


def test_save_16bit_model(tmp_path):
    case = dict(TIED, dtype="bf16", id="bf16")
    engine, model = build(case)
    train(engine, case, 0, 1)
    path = engine.save_16bit_model(str(tmp_path))
    tensors = load_file(path)
    want = model.state_dict()
    assert list(tensors) == list(want)  # tied names each present, buffers included
    for k, v in want.items():
        assert tensors[k].dtype == v.dtype and torch.equal(tensors[k], v.cpu()), k
    assert tensors["emb.weight"].dtype == torch.bfloat16
    TiedTiny().to(torch.bfloat16).load_state_dict(tensors, strict=True)

    bin_path = engine.save_16bit_model(
        str(tmp_path), "pytorch_model.bin", exclude_frozen_parameters=True
    )
    loaded = torch.load(bin_path, weights_only=True)
    assert "frozen.weight" not in loaded and torch.equal(loaded["l1.weight"], want["l1.weight"])
    engine.destroy()


def test_load_module_only_and_without_optimizer_states(saved):
    root, state = saved
    for kw in ({"load_module_only": True}, {"load_optimizer_states": False}):
        engine, model = build(TIED)
        train(engine, TIED, 0, 1)
        so = engine.opt_groups[0].optimizer
        m_before, steps_before = so.exp_avg.clone(), so.step_count
        engine.load_checkpoint(str(root), **kw)
        got = snapshot(engine, model)
        for k, v in state["module"].items():
            assert torch.equal(got["module"][k], v), (kw, k)
        for name, p in model.named_parameters():  # the master restarts from the loaded weights
            if p.requires_grad:
                assert torch.equal(got["master"][name], p.detach().float()), (kw, name)
        assert torch.equal(so.exp_avg, m_before) and so.step_count == steps_before, kw
        want_counters = [1, 2, 1, 0] if kw.get("load_module_only") else state["counters"]
        assert got["counters"] == want_counters, kw
        engine.destroy()


def _two_group_engine(split: bool):
    from checkpoint_helpers import case_config
    from parity import make_model

    import zero_offload

    model = make_model()
    params = [p for p in model.parameters() if p.requires_grad]
    groups = (
        [
            {"params": [p for p in params if p.dim() > 1]},
            {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0, "lr": 3e-3},
        ]
        if split
        else [{"params": params}]
    )
    case = dict(TIED, tied=False)
    engine, _, _, _ = zero_offload.initialize(
        model=model, model_parameters=groups, config=case_config(case)
    )
    return engine, model, case


def test_two_param_groups_roundtrip_and_mismatch(tmp_path):
    from zero_offload.checkpoint import CheckpointError

    engine, model, case = _two_group_engine(split=True)
    train(engine, case, 0, 2)
    want = snapshot(engine, model)
    hypers = [dict(g.hyper) for g in (og.flat for og in engine.opt_groups)]
    engine.save_checkpoint(str(tmp_path))
    engine.destroy()

    engine, model, _ = _two_group_engine(split=True)
    engine.load_checkpoint(str(tmp_path))
    got = snapshot(engine, model)
    for k, v in want["master"].items():
        assert torch.equal(got["master"][k], v), k
    assert len(engine.opt_groups) == 2
    for g, h in zip((og.flat for og in engine.opt_groups), hypers):
        assert g.hyper["lr"] == h["lr"] and g.hyper["weight_decay"] == h["weight_decay"]
    assert engine.opt_groups[1].optimizer.step_count == 2
    engine.destroy()

    engine, model, _ = _two_group_engine(split=False)
    with pytest.raises(CheckpointError, match="2 param groups saved, the engine has 1"):
        engine.load_checkpoint(str(tmp_path))
    engine.destroy()
