"""Whole-model reads of a stage-3 model: every weight partitioned (threshold 0), then exported
with save_pretrained, save_16bit_model and the checkpoint's model file. Each must hold the trained
values, never the empty (numel 0) params a partitioned model shows outside a gather."""

from __future__ import annotations

import pytest
import torch
from hf_models import assert_partitioned, ds_config, engine_train, tiny_model, token_batches

transformers = pytest.importorskip("transformers")


def _train_and_export(out: str, world: int = 1):
    import safetensors.torch

    import zero_offload
    from zero_offload.checkpoint.module_state import module_state
    from zero_offload.core.status import PartitionedParamError
    from zero_offload.hf import CausalLMLoss, export_pretrained
    from zero_offload.utils import safe_get_full_fp32_param

    rank = zero_offload.comm.get_rank()
    hf = tiny_model("llama")
    cfg = ds_config(3, True, gas=1)
    cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    engine, *_ = zero_offload.initialize(model=CausalLMLoss(hf), config=cfg)
    assert_partitioned(hf)
    engine_train(engine, token_batches(2, 2 * world), world, rank)
    with pytest.raises(PartitionedParamError, match="partitioned"):
        export_pretrained(hf, f"{out}/outside")
    with pytest.raises(PartitionedParamError):
        module_state(hf)
    masters = {n: safe_get_full_fp32_param(p) for n, p in hf.named_parameters()}
    with engine.params_on_host():  # every rank: a collective
        if rank == 0:
            export_pretrained(hf, f"{out}/hf_model")
    assert engine.save_16bit_model(f"{out}/s16")
    engine.save_checkpoint(f"{out}/ckpt")
    assert_partitioned(hf)  # the gathers left nothing behind
    s16 = from_ckpt = None
    if rank == 0:
        s16 = safetensors.torch.load_file(f"{out}/s16/model.safetensors")
        from_ckpt = zero_offload.get_fp32_state_dict_from_zero_checkpoint(f"{out}/ckpt")
    engine.destroy()
    return {"masters": masters, "s16": s16, "ckpt": from_ckpt}


def _check(out, folder) -> None:
    masters = out["masters"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(f"{folder}/hf_model")
    got = dict(loaded.named_parameters())
    assert set(got) == set(masters)
    initial = dict(tiny_model("llama").named_parameters())
    for n, want in masters.items():
        assert torch.equal(got[n].detach(), want), n  # fp32 training: 16-bit params == masters
        assert torch.equal(out["s16"]["model." + n], want), n
        assert torch.equal(out["ckpt"]["model." + n], want), n
    assert any(not torch.equal(initial[n], masters[n]) for n in masters)  # it trained


def test_stage3_exports_hold_the_trained_weights_one_rank(tmp_path):
    _check(_train_and_export(str(tmp_path)), tmp_path)


def test_stage3_exports_hold_the_trained_weights_two_ranks(tmp_path):
    from distributed import run_ranks

    _check(run_ranks(2, _train_and_export, str(tmp_path), 2), tmp_path)
