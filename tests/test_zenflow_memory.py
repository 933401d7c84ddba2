"""ZenFlow's buffers in the estimate (``runtime/plan/zenflow_memory.py``: ``expected_memory()``,
``predict`` and ``zero-offload estimate``) equal what ``memory_report()`` counts on a real engine,
and ``offload_states()`` moves the device moments of the selected columns and brings them back
bit for bit."""

from __future__ import annotations

import os

import pytest
import torch
from zenflow_run import TOPK, config

import zero_offload
from zero_offload.cli.main import main as cli_main
from zero_offload.models.gpt2 import GPT2Config, GPT2Model
from zero_offload.runtime.update.buffers import OffloadStateType

TERMS = ("device.zenflow_columns", "host.zenflow_accum", "host.zenflow_overlap")
SHAPE = GPT2Config(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                   vocab_size=64)  # fmt: skip


@pytest.fixture(autouse=True)
def _one_rank(monkeypatch):
    for k, v in {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "LOCAL_RANK": "0",
                 "WORLD_SIZE": "1"}.items():  # fmt: skip
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("MASTER_PORT", str(29500 + os.getpid() % 2000))


def _engine(zf: dict, dtype: str | None = None):
    torch.manual_seed(0)
    model = GPT2Model(SHAPE)
    cfg = config(zf)
    if dtype is not None:
        cfg[dtype] = {"enabled": True}
    engine, *_ = zero_offload.initialize(model=model, model_parameters=model.parameters(),
                                         config=cfg)  # fmt: skip
    return engine


def _train(engine, steps: int, g: torch.Generator | None = None) -> None:
    g = g if g is not None else torch.Generator().manual_seed(2)
    for _ in range(steps):
        ids = torch.randint(0, SHAPE.vocab_size, (2, SHAPE.seq_length), generator=g)
        engine.backward(engine(ids, labels=ids))
        engine.step()


@pytest.mark.parametrize(
    "zf, dtype",
    [
        (TOPK, None),
        ({**TOPK, "overlap_step": True, "topk_ratio": 0.1}, None),
        (TOPK, "bf16"),
        (TOPK, "fp16"),
    ],  # fmt: skip
    ids=["fp32", "overlap", "bf16", "fp16"],
)
def test_estimate_equals_memory_report(zf, dtype):
    engine = _engine(zf, dtype)
    _train(engine, 3)
    have = engine.memory_report()
    states = engine.expected_memory()
    predicted = engine.expected_memory(seq_length=SHAPE.seq_length, micro_batch=2)
    for k in TERMS:
        if k == "host.zenflow_overlap" and not zf.get("overlap_step"):
            assert k not in have and k not in states and k not in predicted
            continue
        assert have[k] > 0, k
        assert states[k] == have[k], (k, states[k], have[k])
        assert predicted[k] == have[k], (k, predicted[k], have[k])


def test_plain_offload_has_no_zenflow_terms():
    engine = _engine(None)  # config(None): plain ZeRO-Offload
    assert not any(
        k.startswith(("device.zenflow", "host.zenflow")) for k in engine.expected_memory()
    )


def test_cli_estimate_counts_zenflow(tmp_path, capsys):
    """``--config`` with a zenflow block: the step table's stage-2 cpu row counts its terms (as
    ``predict`` does, compared with the engine above); ``--topk-ratio``
    (``zero_optimization.zenflow.topk_ratio``) counts the same without a config."""
    import json

    path = tmp_path / "ds.json"
    base = ["estimate", "--model", "gpt2", "--num-layers", "2", "--hidden-size", "256",
            "--num-attention-heads", "4", "--seq-length", "64", "--vocab-size", "1000",
            "--dtype", "fp32"]  # fmt: skip

    def zenflow_lines(args):
        assert cli_main(args) == 0
        return [ln.strip() for ln in capsys.readouterr().out.splitlines() if "zenflow (in" in ln]

    path.write_text(json.dumps(config(None)))
    assert zenflow_lines([*base, "--config", str(path)]) == []
    path.write_text(json.dumps(config({**TOPK, "topk_ratio": 0.5})))
    by_config = zenflow_lines([*base, "--config", str(path)])
    assert len(by_config) == 1 and "device.zenflow_columns" in by_config[0]
    by_flag = zenflow_lines([*base, "--stage", "2", "--topk-ratio", "0.5"])
    assert by_flag == by_config  # the stage 2 cpu row only (nvme: no ZenFlow)
    stage3 = zenflow_lines([*base, "--stage", "3", "--topk-ratio", "0.5"])
    assert len(stage3) == 2 and all("host.zenflow_index" in ln for ln in stage3)  # cpu rows


@pytest.mark.parametrize("overlap", [False, True])
def test_offload_states_moves_the_column_moments(overlap):
    """The selected columns' device moments (and indices) are optimizer state: they move with
    ``optim_states`` (with overlap_step too: the host update never reads them) and training goes
    on bitwise after the reload."""
    zf = {**TOPK, "overlap_step": overlap}
    engine, g = _engine(zf), torch.Generator().manual_seed(2)
    _train(engine, 3, g)
    cols = engine.opt_groups[0].optimizer.runner.columns
    before = [(c.exp_avg.clone(), c.exp_avg_sq.clone()) for c in cols]
    on_device = engine.memory_report()["device.zenflow_columns"]
    engine.offload_states(include=[OffloadStateType.optim_states])
    rep = engine.memory_report()
    assert rep["device.zenflow_columns"] == 0
    assert rep["host.zenflow_columns"] == on_device
    assert all(c.exp_avg.untyped_storage().nbytes() == 0 for c in cols)
    engine.reload_states()
    for c, (m, v) in zip(cols, before):
        assert torch.equal(c.exp_avg, m) and torch.equal(c.exp_avg_sq, v)
    _train(engine, 3, g)
    ref, g = _engine(zf), torch.Generator().manual_seed(2)
    _train(ref, 6, g)
    for p, q in zip(engine.module.parameters(), ref.module.parameters()):
        assert torch.equal(p, q)
