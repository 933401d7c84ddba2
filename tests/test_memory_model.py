"""The memory model predicts before the run: its states equal what the engine allocates (for every
placement), its working-set bounds hold what a step measured, the model shapes count the params
the real models have, and a working set that cannot fit is an error naming the key to change."""

from __future__ import annotations

import copy

import pytest
import torch
from parity import assert_partitioned_if_asked

from zero_offload.config.loading.load import load_config
from zero_offload.runtime.plan.memory_model import StepShape, ZeroPlan, predict
from zero_offload.runtime.plan.model_shape import ModelShape

# (stage, offload_optimizer, offload_param): the placements
PLACEMENTS = [(2, None, None), (2, "cpu", None), (3, "cpu", "cpu"), (3, "nvme", "nvme")]


def _config(stage: int, opt, param, nvme, bucket: int = 3000) -> dict:
    zero: dict = {"stage": stage, "reduce_bucket_size": bucket, "overlap_comm": True}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_max_live_parameters=20_000)
    for key, dev in (("offload_optimizer", opt), ("offload_param", param)):
        if dev:
            zero[key] = {"device": dev, **({"nvme_path": str(nvme)} if dev == "nvme" else {})}
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": zero,
        "steps_per_print": 10**6,
    }


def _gpt2():
    from zero_offload.models.gpt2 import GPT2Config, GPT2Model

    torch.manual_seed(0)  # every size a multiple of 16: no padding, the formula is exact
    return GPT2Model(GPT2Config(num_layers=2, hidden_size=32, num_attention_heads=2,
                                seq_length=16, vocab_size=128))  # fmt: skip


@pytest.mark.parametrize("stage,opt,param", PLACEMENTS)
def test_states_and_bounds_match_the_engine(tmp_path, stage, opt, param):
    import zero_offload

    model = _gpt2()
    cfg = _config(stage, opt, param, tmp_path)
    engine, *_ = zero_offload.initialize(model=model, config=copy.deepcopy(cfg))
    assert_partitioned_if_asked(model, cfg)
    x = torch.randint(0, 128, (2, 16))
    for _ in range(2):
        engine.reset_peak_memory()  # the last step's peaks: after the order was learned
        engine.backward(engine(x, x))
        engine.step()
    have = engine.memory_report()
    shape = ModelShape.from_config(model.config)
    assert shape.numel() == sum(p.ds_numel if stage == 3 else p.numel() for p in model.parameters())
    want = predict(shape, StepShape(2, 16), ZeroPlan.from_config(load_config(cfg), 1))
    states = {k: v for k, v in want.items() if not k.startswith("peak.")}
    spares = states.pop("host.param_spares", 0)
    assert states == {
        k: v
        for k, v in have.items()
        if not k.startswith(("peak.", "host.param_cache", "host.param_spares"))
    }
    # NVMe params: the read buffers kept for reuse within their bound (the cache is empty now)
    assert have.get("host.param_spares", 0) <= spares
    assert have.get("host.param_cache", 0) == 0
    # every transient the step measured is within its predicted term
    if opt is None:  # one rank, a device grad shard: the hooks fill it, no reduce buffer
        assert have["peak.device.reduce_buffers"] == 0
    else:
        assert 0 < have["peak.device.reduce_buffers"] <= want["peak.device.reduce_buffers"]
    assert have["peak.device.held_grads"] <= want["peak.device.grads"]
    if stage == 3:
        assert 0 < have["peak.device.gathered_params"] <= want["peak.device.gathered_params"]
    # the engine's own prediction: the same terms, over its exact states
    mine = engine.expected_memory(seq_length=16)
    assert mine["peak.device.activations"] == want["peak.device.activations"]
    assert mine["peak.device.total"] >= sum(v for k, v in have.items() if k.startswith("device."))


def test_shapes_count_the_real_models():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip
    llama = transformers.AutoModelForCausalLM.from_config(cfg)
    assert ModelShape.from_config(cfg).numel() == sum(p.numel() for p in llama.parameters())
    g = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=16)
    gpt2 = transformers.AutoModelForCausalLM.from_config(g)
    assert ModelShape.from_config(g).numel() == sum(p.numel() for p in gpt2.parameters())
    assert ModelShape.from_config(_gpt2().config).numel() == sum(
        p.numel() for p in _gpt2().parameters()
    )


@pytest.mark.parametrize(
    "stage,key", [(2, "reduce_bucket_size"), (3, "stage3_max_live_parameters")]
)
def test_a_working_set_that_cannot_fit_names_the_key(monkeypatch, stage, key):
    import zero_offload
    import zero_offload.runtime.engine.engine as engine_module

    monkeypatch.setattr(engine_module, "free_bytes", lambda device: 1000)
    cfg = _config(stage, "cpu", "cpu" if stage == 3 else None, None, bucket=10**6)
    with pytest.raises(MemoryError, match=key):
        zero_offload.initialize(model=_gpt2(), config=cfg)


def test_persistent_params_are_held_as_states():
    """Stage 3 with units within ``stage3_param_persistence_threshold`` (the layer norms): they
    stay gathered after the step, and the prediction and the engine count them as states."""
    import zero_offload

    model = _gpt2()
    cfg = _config(3, "cpu", None, None)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 64  # a norm's weight+bias
    engine, *_ = zero_offload.initialize(model=model, config=copy.deepcopy(cfg))
    x = torch.randint(0, 128, (2, 16))
    engine.backward(engine(x, x))
    engine.step()
    have = engine.memory_report()
    norms = sum(1 for m in model.modules() if isinstance(m, torch.nn.LayerNorm))
    assert have["device.persistent_params"] == norms * 64 * 4 > 0  # fp32 weight + bias
    shape = ModelShape.from_config(model.config)
    want = predict(shape, StepShape(2, 16), ZeroPlan.from_config(load_config(cfg), 1))
    assert want["device.persistent_params"] == have["device.persistent_params"]
    assert engine.expected_memory()["device.persistent_params"] == have["device.persistent_params"]
    assert "device.gathered_params" not in have  # nothing else stays gathered
    engine.destroy()
