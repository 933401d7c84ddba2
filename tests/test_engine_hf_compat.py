"""The DeepSpeed engine names the Hugging Face libraries call beyond a training loop's
(``runtime/engine_compat.py``): ``zero_gather_16bit_weights_on_model_save``,
``_zero3_consolidated_16bit_state_dict``, ``engine.config.get`` / ``[]`` / ``in`` (DeepSpeed's
``engine.config`` is its config dict), ``optimizer.overflow``; and the namespace's small adapters
that need no opt-in to test (``clone_tensors_for_torch_save``, the config reading)."""

from __future__ import annotations

import pytest
import torch

import zero_offload
from zero_offload.deepspeed_compat import as_zero_offload_config
from zero_offload.deepspeed_compat.checkpoint.utils import clone_tensors_for_torch_save


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.mid = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.register_buffer("scale", torch.tensor([2.0]))

    def forward(self, x):
        return self.head(torch.tanh(self.mid(self.emb(x))) * self.scale).logsumexp(-1).mean()


def _engine(stage: int, gather: bool = True):
    """A tiny engine with a tied weight and a buffer; the gather-on-save flag at stage 3."""
    torch.manual_seed(0)
    model = Tied()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
        zero["stage3_gather_16bit_weights_on_model_save"] = gather
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": zero,
    }
    engine, *_ = zero_offload.initialize(model=model, config=cfg)
    return engine, initial


def test_consolidated_state_dict_at_stage3():
    engine, initial = _engine(3)
    try:
        assert engine.zero_optimization_partition_weights()
        assert engine.zero_gather_16bit_weights_on_model_save()
        assert all(p.numel() == 0 for p in engine.module.parameters())
        sd = engine._zero3_consolidated_16bit_state_dict()
        assert sorted(sd) == sorted(initial)
        for k, v in sd.items():
            assert v.device.type == "cpu"
            torch.testing.assert_close(v, initial[k], rtol=0, atol=0)
        # tied names are one tensor; every other tensor has its own storage (save_pretrained
        # treats tensors sharing a storage as tied)
        assert sd["head.weight"].data_ptr() == sd["emb.weight"].data_ptr()
        storages = {sd[k].untyped_storage().data_ptr() for k in sd if k != "head.weight"}
        assert len(storages) == len(sd) - 1
        assert all(p.numel() == 0 for p in engine.module.parameters())  # partitioned again
        frozen = engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)
        assert sorted(frozen) == sorted(sd)  # nothing frozen here
    finally:
        engine.destroy()


def test_consolidated_state_dict_needs_stage3_and_gather_flag_is_reported():
    engine, _ = _engine(2)
    try:
        assert not engine.zero_optimization_partition_weights()
        assert not engine.zero_gather_16bit_weights_on_model_save()
        with pytest.raises(ValueError, match="requires ZeRO-3 mode"):
            engine._zero3_consolidated_16bit_state_dict()
    finally:
        engine.destroy()


def test_config_reads_like_deepspeeds_config_dict():
    engine, _ = _engine(3)
    try:
        cfg = engine.config
        assert cfg.get("zero_optimization", {}).get("stage") == 3  # transformers' save_model
        assert cfg["train_micro_batch_size_per_gpu"] == 2
        assert "optimizer" in cfg and "no_such_key" not in cfg
        assert cfg.get("no_such_key", "default") == "default"
        assert cfg.zero_optimization.stage == 3  # still the typed config
    finally:
        engine.destroy()


def test_optimizer_overflow_reports_a_skipped_step():
    engine, _ = _engine(2)
    try:
        x = torch.randint(0, 16, (2, 4))
        assert engine.optimizer.overflow is False
        engine.backward(engine(x))
        engine.step()
        assert engine.optimizer.overflow is False and engine.was_step_applied()
        engine.backward(engine(x) * float("inf"))
        engine.step()
        assert engine.optimizer.overflow is True and not engine.was_step_applied()
        engine.backward(engine(x))
        engine.step()
        assert engine.optimizer.overflow is False
    finally:
        engine.destroy()


def test_clone_tensors_for_torch_save():
    base = torch.arange(6.0)
    item = {"a": base[:3], "b": [base[3:], (base, 7)], "c": "text"}
    out = clone_tensors_for_torch_save(item)
    assert out["c"] == "text" and out["b"][1][1] == 7
    for got, want in ((out["a"], base[:3]), (out["b"][0], base[3:]), (out["b"][1][0], base)):
        torch.testing.assert_close(got, want)
        assert got.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
        assert got.numel() == got.untyped_storage().nbytes() // got.element_size()


def test_hugging_face_settings_read_as_deepspeed_reads_them():
    cfg = {"steps_per_print": float("inf"), "zero_allow_untested_optimizer": True, "x": 1}
    assert as_zero_offload_config(cfg) == {"x": 1}
    assert cfg["steps_per_print"] == float("inf")  # the caller's dict is left alone
    assert as_zero_offload_config({"steps_per_print": 10}) == {"steps_per_print": 10}
    assert as_zero_offload_config("ds.json") == "ds.json"
