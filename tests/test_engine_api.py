"""DeepSpeed's engine accessors and accumulation controls, zero_offload.comm and
zero_offload.utils.zero_to_fp32: each name behaves as DeepSpeed's does."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from parity import batches, engine_config, make_model

import zero_offload
import zero_offload as deepspeed


def _engine(**kw):
    cfg = engine_config(**{"clip": 1.0, "overlap": False, "micro": 2, **kw})
    engine, *_ = zero_offload.initialize(model=make_model(), config=cfg)
    return engine


def _params(engine):
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def test_accessors_name_the_config():
    cfg = engine_config(
        stage=2, offload=True, gas=2, micro=2, clip=0.5, overlap=False, dtype="fp16"
    )
    cfg["steps_per_print"] = 7
    engine, *_ = deepspeed.initialize(model=make_model(), config=cfg)
    assert engine.zero_optimization_stage() == 2
    assert engine.fp16_enabled() and not engine.bfloat16_enabled()
    assert engine.gradient_clipping() == 0.5 and engine.steps_per_print() == 7
    assert engine.dynamic_loss_scale() is True
    assert engine.zero_cpu_offload() is True
    assert engine.zero_offload_optimizer().device == "cpu"
    assert engine.get_data_types() == (torch.float16, torch.float16)
    # loss_scale: the current scale as a number, and DeepSpeed's method (the configured value).
    assert float(engine.loss_scale) == 2.0**8 and engine.loss_scale * 2 == 2.0**9
    assert engine.loss_scale() == 0.0
    assert type(pickle.loads(pickle.dumps(engine.loss_scale))) is float

    plain = _engine(stage=1, offload=False, gas=1)
    assert plain.zero_optimization_stage() == 1 and not plain.fp16_enabled()
    assert plain.zero_cpu_offload() is False and plain.zero_offload_optimizer() is None
    assert plain.get_data_types() == (torch.float32, torch.float32)
    assert float(plain.loss_scale) == 1.0


def test_was_step_applied_follows_boundaries_and_overflow():
    engine = _engine(stage=2, offload=False, gas=2, dtype="fp16")
    assert engine.was_step_applied() is False
    (x, y), (x2, y2) = batches(2, 1, 2, 2)
    engine.backward(engine(x[:2], y[:2]))
    engine.step()
    assert engine.was_step_applied() is False  # inside the window
    engine.backward(engine(x[2:], y[2:]))
    engine.step()
    assert engine.was_step_applied() is True
    before = _params(engine)
    engine.backward(engine(x2[:2], y2[:2]) * float("inf"))
    engine.step()
    engine.backward(engine(x2[2:], y2[2:]))
    engine.step()
    assert engine.was_step_applied() is False and engine.skipped_steps == 1
    assert all(torch.equal(before[n], p) for n, p in _params(engine).items())


@pytest.mark.parametrize("stage,offload", [(1, False), (2, False), (2, True)])
def test_set_gradient_accumulation_boundary_equals_counted_window(stage, offload):
    data = batches(2, 1, 2, 2)
    counted = _engine(stage=stage, offload=offload, gas=2)
    for x, y in data:
        for k in range(2):
            counted.backward(counted(x[2 * k : 2 * k + 2], y[2 * k : 2 * k + 2]))
            counted.step()
    manual = _engine(stage=stage, offload=offload, gas=2)
    for x, y in data:  # DeepSpeed's documented pattern: one step() per window
        manual.set_gradient_accumulation_boundary(False)
        manual.backward(manual(x[:2], y[:2]))
        manual.set_gradient_accumulation_boundary(True)
        assert manual.is_gradient_accumulation_boundary()
        manual.backward(manual(x[2:], y[2:]))
        manual.step()
        assert manual.was_step_applied()
    assert manual.global_steps == 2
    a, b = _params(counted), _params(manual)
    assert all(torch.equal(a[n], b[n]) for n in a)
    with pytest.raises(ValueError, match="is_boundary"):
        manual.set_gradient_accumulation_boundary(1)


def test_no_sync_accumulates_locally_then_reduces():
    (x, y), (x2, y2) = batches(2, 1, 2, 2)
    synced = _engine(stage=1, offload=False, gas=1, clip=0.0)
    for xb, yb in ((x, y), (x2, y2)):
        synced.backward(synced(xb[:2], yb[:2]) + synced(xb[2:], yb[2:]))
        synced.step()
    engine = _engine(stage=1, offload=False, gas=1, clip=0.0)
    for xb, yb in ((x, y), (x2, y2)):
        with engine.no_sync():
            engine.backward(engine(xb[:2], yb[:2]))
            with pytest.raises(RuntimeError, match="illegal"):
                engine.step()
            with pytest.raises(RuntimeError, match="reentry"):
                with engine.no_sync():
                    pass
        engine.backward(engine(xb[2:], yb[2:]))
        engine.step()
    a, b = _params(synced), _params(engine)
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="stage 2"):
        with _engine(stage=2, offload=False, gas=1).no_sync():
            pass


def test_backward_scale_wrt_gas_and_return_value():
    ((x, y),) = batches(1, 1, 2, 2)
    scaled = _engine(stage=2, offload=False, gas=2)
    unscaled = _engine(stage=2, offload=False, gas=2)
    for k in range(2):
        xb, yb = x[2 * k : 2 * k + 2], y[2 * k : 2 * k + 2]
        loss = scaled(xb, yb)
        out = scaled.backward(loss)
        torch.testing.assert_close(out, loss / 2)  # DeepSpeed returns the GAS-scaled loss
        scaled.step()
        out = unscaled.backward(unscaled(xb, yb) / 2, scale_wrt_gas=False)
        unscaled.step()
    a, b = _params(scaled), _params(unscaled)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_set_train_batch_size_changes_accumulation():
    engine = _engine(stage=1, offload=False, gas=1)
    ((x, y),) = batches(1, 1, 2, 2)
    engine.backward(engine(x[:2], y[:2]))
    engine.step()
    before = engine.config
    engine.set_train_batch_size(4)
    assert engine.train_batch_size() == 4 and engine.gradient_accumulation_steps() == 2
    # A new config for the engine; the one held before keeps its settings (configs are read-only).
    assert engine.config["train_batch_size"] == 4 and before.train_batch_size == 2
    flags = []
    for k in range(4):
        flags.append(engine.is_gradient_accumulation_boundary())
        engine.backward(engine(x[:2], y[:2]))
        if k == 0:
            with pytest.raises(RuntimeError, match="inside an accumulation window"):
                engine.set_train_batch_size(2)
        engine.step()
    assert flags == [False, True, False, True] and engine.global_steps == 3
    with pytest.raises(ValueError, match="multiple of train_micro_batch_size_per_gpu 2"):
        engine.set_train_batch_size(3)
    # stage 2 + offload built with GAS 1 accumulates too: test_engine_compat


def test_save_fp16_model_writes_pytorch_model_bin(tmp_path):
    engine = _engine(stage=2, offload=False, gas=1, dtype="bf16")
    engine.save_fp16_model(str(tmp_path))
    state = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    assert state["l1.weight"].dtype == torch.bfloat16
    assert torch.equal(state["l1.weight"], engine.module.l1.weight.detach())


def test_comm_names_in_a_world_of_one():
    comm = deepspeed.comm
    comm.init_distributed(dist_backend="gloo")  # no launcher: a world of one, nothing created
    assert comm.is_available() and not comm.is_initialized()
    assert comm.get_rank() == 0 and comm.get_world_size() == 1 and comm.get_local_rank() == 0
    t = torch.ones(3)
    comm.all_reduce(t)
    comm.broadcast(t, src=0)
    comm.barrier()
    out = [torch.zeros(3)]
    comm.all_gather(out, t)
    assert torch.equal(t, torch.ones(3)) and torch.equal(out[0], t)
    with pytest.raises(ValueError, match="rank"):
        comm.init_distributed(init_method="tcp://127.0.0.1:1")


def test_comm_init_method_makes_the_rank_gpu_current_before_nccl_starts(monkeypatch):
    """nccl with an explicit rank: the rank's GPU is current before the group exists (its first
    collective and object collectives run there), and the engine picks the same one."""
    from zero_offload.core import dist as rt

    calls = []
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.delenv("LOCAL_RANK")  # restored to its original state at teardown
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(
        torch.distributed, "init_process_group", lambda **kw: calls.append(("init", kw["backend"]))
    )
    deepspeed.comm.init_distributed(
        dist_backend="nccl", init_method="tcp://127.0.0.1:1", rank=3, world_size=4
    )
    assert calls == [("set_device", 1), ("init", "nccl")]
    assert rt.local_rank() == 1


def test_engine_makes_its_cuda_device_current(monkeypatch):
    """The engine's streams and events use the current device: it must be the engine's."""
    from zero_offload.core import dist as rt

    class Stop(Exception):
        pass

    def set_device(d):
        raise Stop(d)

    monkeypatch.setattr(rt, "default_device", lambda: torch.device("cuda", 1))
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    with pytest.raises(Stop) as err:
        _engine(stage=1, offload=False, gas=1)
    assert err.value.args[0] == torch.device("cuda", 1)


def test_deepspeed_module_paths_exist():
    from zero_offload.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from zero_offload.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    assert deepspeed.ops.adam.DeepSpeedCPUAdam is DeepSpeedCPUAdam
    assert deepspeed.ops.adam.FusedAdam is FusedAdam
    assert callable(get_fp32_state_dict_from_zero_checkpoint)


def test_zero_to_fp32_returns_the_master_weights(tmp_path):
    from zero_offload.utils import safe_get_full_fp32_param
    from zero_offload.utils.zero_to_fp32 import (
        get_fp32_state_dict_from_zero_checkpoint,
        load_state_dict_from_zero_checkpoint,
    )

    engine = _engine(stage=2, offload=True, gas=1, dtype="bf16")
    ((x, y),) = batches(1, 1, 1, 2)
    engine.backward(engine(x, y))
    engine.step()
    engine.save_checkpoint(str(tmp_path))
    state = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))
    weight = engine.module.l1.weight
    assert state["l1.weight"].dtype == torch.float32
    assert torch.equal(state["l1.weight"], safe_get_full_fp32_param(weight))
    model = load_state_dict_from_zero_checkpoint(make_model(seed=5), str(tmp_path))
    assert torch.equal(model.l1.weight.detach(), state["l1.weight"])


def test_module_cast_keeps_buffers_in_their_dtype():
    from zero_offload.runtime.engine.module_cast import cast_params_

    model = make_model()
    model.register_buffer("inv_freq", torch.rand(8, dtype=torch.float32) * 1e-3 + 1.0)
    model.register_buffer("count", torch.arange(3))
    expected = model.inv_freq.clone()
    params = list(model.parameters())
    cast_params_(model, torch.device("cpu"), torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    assert model.inv_freq.dtype == torch.float32 and torch.equal(model.inv_freq, expected)
    assert model.count.dtype == torch.int64
    with pytest.raises(ValueError, match="floating"):
        cast_params_(model, torch.device("cpu"), torch.int8)
    copy.deepcopy(model)
