"""DeepSpeed engine behaviours scripts rely on: checkpoints without frozen params and
non-strict module loads, accumulation switched on later at stage 2 + offload, the stage-3 partition
cache and ``ds_persist``, attribute pass-through to the module, ``RepeatingLoader``."""

from __future__ import annotations

import copy

import pytest
import torch
from parity import (
    assert_partitioned_if_asked,
    batches,
    displacement_err,
    engine_config,
    make_model,
)
from safetensors import safe_open

import zero_offload
from zero_offload.core.status import ZeroParamStatus
from zero_offload.utils import RepeatingLoader, safe_get_full_fp32_param

THRESHOLD_0 = {"stage3_param_persistence_threshold": 0}


def _engine(stage: int, offload: bool = False, gas: int = 1, seed: int = 0, **zero):
    torch.manual_seed(seed)
    model = make_model(seed)
    cfg = engine_config(
        stage, offload, gas, 2, 0.0, overlap=False, zero_extra=zero or None,
        offload_param=offload and stage == 3,
    )  # fmt: skip
    engine, *_ = zero_offload.initialize(model=model, config=cfg)
    assert_partitioned_if_asked(model, cfg)
    return engine, model


def _train(engine, steps: int = 2) -> None:
    gas = engine.gradient_accumulation_steps()
    for x, y in batches(steps, 1, gas, 2):
        for k in range(gas):
            engine.backward(engine(x[2 * k : 2 * k + 2], y[2 * k : 2 * k + 2]))
            engine.step()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_checkpoint_without_frozen_params(stage, tmp_path):
    zero = THRESHOLD_0 if stage == 3 else {}
    engine, model = _engine(stage, **zero)
    _train(engine)
    engine.save_checkpoint(tmp_path / "all")
    engine.save_checkpoint(tmp_path / "trainable", exclude_frozen_parameters=True)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen
    keys = {}
    for kind in ("all", "trainable"):
        with safe_open(str(tmp_path / kind / "global_step2" / "model.safetensors"), "pt") as f:
            keys[kind] = set(f.keys())
    assert frozen <= keys["all"] and not frozen & keys["trainable"]
    want = {n: safe_get_full_fp32_param(p) for n, p in model.named_parameters() if p.requires_grad}
    engine.destroy()

    fresh, fresh_model = _engine(stage, seed=1, **zero)  # other initial weights everywhere
    with zero_offload.zero.GatheredParameters(list(fresh_model.parameters())):
        own_frozen = {
            n: p.detach().clone() for n, p in fresh_model.named_parameters() if n in frozen
        }
    fresh.load_checkpoint(tmp_path / "trainable")
    for n, p in fresh_model.named_parameters():
        if p.requires_grad:
            assert torch.equal(safe_get_full_fp32_param(p), want[n]), n
    with zero_offload.zero.GatheredParameters(list(fresh_model.parameters())):
        for n, p in fresh_model.named_parameters():
            if n in frozen:  # not in the file: the model keeps its own value
                assert torch.equal(p.detach(), own_frozen[n]), n
    fresh.destroy()


def test_non_strict_module_load_and_deepspeed_argument_order(tmp_path):
    engine, _ = _engine(1)
    engine.save_checkpoint(tmp_path)
    engine.destroy()
    torch.manual_seed(0)
    model = make_model()
    model.extra = torch.nn.Linear(2, 2).requires_grad_(False)  # keys the checkpoint lacks
    cfg = engine_config(1, False, 1, 2, 0.0, overlap=False)
    engine, *_ = zero_offload.initialize(model=model, config=cfg)
    with pytest.raises(Exception, match="state dict keys differ"):
        engine.load_checkpoint(tmp_path)
    path, _ = engine.load_checkpoint(tmp_path, None, False)  # load_module_strict, positionally
    assert path is not None
    with pytest.raises(NotImplementedError, match="custom_load_fn"):
        engine.load_checkpoint(tmp_path, custom_load_fn=lambda *a: None)
    engine.destroy()


@pytest.mark.parametrize("stage", [2, 3])
def test_accumulation_switched_on_later_with_offload(stage):
    """Built with GAS 1 (no device gradient kept), then set_train_batch_size doubles the batch:
    the same training as an engine built with GAS 2."""
    zero = THRESHOLD_0 if stage == 3 else {}
    ref, ref_model = _engine(stage, True, gas=2, **zero)
    init = {n: p.detach().clone() for n, p in make_model().named_parameters() if p.requires_grad}
    _train(ref)
    got, model = _engine(stage, True, gas=1, **zero)
    got.set_train_batch_size(4)
    assert got.gradient_accumulation_steps() == 2
    _train(got)
    a = {n: safe_get_full_fp32_param(p) for n, p in model.named_parameters() if p.requires_grad}
    b = {n: safe_get_full_fp32_param(p) for n, p in ref_model.named_parameters() if p.requires_grad}
    assert displacement_err(a, b, init) < 1e-6
    ref.destroy()
    got.destroy()


def test_boundary_override_accumulates_at_stage2_offload_gas1():
    ref, ref_model = _engine(2, True, gas=2)
    _train(ref, steps=1)
    got, model = _engine(2, True, gas=1)
    ((x, y),) = batches(1, 1, 2, 2)
    got.set_gradient_accumulation_boundary(False)
    got.backward(got(x[:2], y[:2]) / 2)  # the engine divides by GAS 1: halve by hand
    got.set_gradient_accumulation_boundary(True)
    got.backward(got(x[2:], y[2:]) / 2)
    got.step()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        if p.requires_grad:
            assert torch.allclose(
                safe_get_full_fp32_param(p), safe_get_full_fp32_param(q), atol=1e-6
            )
    ref.destroy()
    got.destroy()


def test_empty_partition_cache_and_ds_persist():
    engine, model = _engine(3, stage3_param_persistence_threshold=200)
    persist = {n: p.ds_persist for n, p in model.named_parameters()}
    assert any(persist.values()) and not all(persist.values())
    ((x, y),) = batches(1, 1, 1, 2)
    with torch.no_grad():
        before = float(engine(x, y))
    assert any(p.ds_status is ZeroParamStatus.AVAILABLE for p in model.parameters())  # persistent
    engine.empty_partition_cache()
    assert all(p.numel() == 0 for p in model.parameters())
    assert all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in model.parameters())
    with torch.no_grad():
        assert float(engine(x, y)) == before  # gathered again
    with zero_offload.zero.GatheredParameters([model.l1.weight]):
        engine.empty_partition_cache()  # a held param stays
        assert model.l1.weight.numel() > 0
    engine.destroy()
    plain, _ = _engine(1)
    plain.empty_partition_cache()  # nothing partitioned: nothing to do
    plain.destroy()


def test_engine_passes_unknown_attributes_to_its_module():
    engine, model = _engine(2)
    model.vocab_note = "bytes"
    assert engine.vocab_note == "bytes" and engine.l1 is model.l1
    assert engine.module is model and callable(engine.backward)
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        engine.nothing_here  # noqa: B018
    engine.destroy()


def test_repeating_loader_restarts_the_loader():
    loader = torch.utils.data.DataLoader(list(range(5)), batch_size=2)
    it = RepeatingLoader(loader)
    got = [next(it).tolist() for _ in range(4)]
    assert got == [[0, 1], [2, 3], [4], [0, 1]]
    assert iter(it) is it
    with pytest.raises(StopIteration):
        next(RepeatingLoader([]))
    assert copy.copy(it).loader is loader


def test_unwrap_model_for_generation_gathers_once():
    pytest.importorskip("transformers")
    from hf_models import tiny_model

    from zero_offload.zero import unwrap_model_for_generation

    hf = tiny_model("gpt2")
    plain = copy.deepcopy(hf).eval()
    cfg = engine_config(3, True, 1, 2, 0.0, overlap=True, offload_param=True)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine, *_ = zero_offload.initialize(model=hf, config=cfg)
    store = engine.param_store
    starts = []
    start = store.start
    store.start = lambda i: (starts.append(i), start(i))[1]  # count gathers
    ids = torch.tensor([[1, 2, 3]])
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    with unwrap_model_for_generation(engine) as unwrapped:
        assert unwrapped is engine
        gathered = len(starts)
        out = engine.module.generate(ids, **kwargs)
        assert len(starts) == gathered  # no gather per token
    assert torch.equal(out, plain.generate(ids, **kwargs))
    assert all(p.numel() == 0 for p in hf.parameters())  # released after the block
    engine.destroy()


def test_save_16bit_model_in_the_sharded_layout(tmp_path):
    import json

    engine, model = _engine(2)
    assert engine.save_16bit_model(tmp_path, max_shard_size="2KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1 and all((tmp_path / f).is_file() for f in files)
    assert set(index["weight_map"]) == set(model.state_dict())
    engine.destroy()
