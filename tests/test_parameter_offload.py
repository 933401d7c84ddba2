"""TRL's generation unwrap under ZeRO-3 (``trl.models.utils.remove_hooks`` / ``add_hooks``, the
functions ``unwrap_model_for_generation`` calls) on a stage-3 engine: the hooks are really
removed (a forward inside gathers nothing and releases nothing), really put back (training
after it equals plain PyTorch), and the fetch order is recorded afresh."""

from __future__ import annotations

import copy

import pytest
import torch
from parity import engine_config

import zero_offload
from zero_offload.zero import GatheredParameters

trl_utils = pytest.importorskip("trl.models.utils")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)
    )


def _engine(model):
    cfg = engine_config(3, True, 1, 2, 0.0, overlap=False, offload_param=True)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}}
    engine, *_ = zero_offload.initialize(model=model, config=cfg)
    assert all(p.numel() == 0 for p in model.parameters())  # partitioned
    return engine


def _step(engine, x, y):
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    return loss.item()


def test_trl_remove_and_add_hooks_around_generation():
    torch.manual_seed(1)
    data = [(torch.randn(2, 6), torch.randn(2, 3)) for _ in range(4)]
    plain = _model()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.0)
    engine = _engine(_model())
    offload = engine.optimizer.parameter_offload
    assert offload.module is engine.module and engine.optimizer.module is engine.module
    store = engine.param_store
    counts = {"start": 0, "release": 0}
    for name in counts:
        orig = getattr(store, name)

        def counted(*a, _orig=orig, _name=name, **k):
            counts[_name] += 1
            return _orig(*a, **k)

        setattr(store, name, counted)
    losses, want = [], []
    for step, (x, y) in enumerate(data):
        if step >= 1:  # after a recorded pass, as GRPO generates between training steps
            assert not offload.param_coordinator.is_invalid_trace()
            with GatheredParameters(list(engine.module.parameters())):
                trl_utils.remove_hooks(engine)
                assert offload.forward_hooks == [] and offload.backward_hooks == []
                before = dict(counts)
                with torch.no_grad():
                    out = engine.module(x)
                assert counts == before  # no hook ran: nothing fetched or released
                assert torch.allclose(out, plain(x), atol=1e-6)
                trl_utils.add_hooks(engine)
            assert offload.param_coordinator.is_invalid_trace()  # re-recorded on the next pass
            assert len(offload.forward_hooks) == 2 * len(engine.fetch_schedule.modules)
            assert offload.backward_hooks
        losses.append(_step(engine, x, y))
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(plain(x), y)
        loss.backward()
        opt.step()
        want.append(loss.item())
    assert losses == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert not offload.param_coordinator.is_invalid_trace()
    assert all(p.numel() == 0 for p in engine.module.parameters())  # released again
    engine.destroy()


def test_protocol_details():
    engine = _engine(_model())
    offload = engine.optimizer.parameter_offload
    assert engine.optimizer.parameter_offload is offload  # one adapter per engine
    assert all(p.ds_active_sub_modules == set() for p in engine.module.parameters())
    assert engine.module.ds_external_parameters() == []
    zero_offload.zero.register_external_parameter(engine.module, engine.module[0].weight)
    assert [p for _, p in engine.module.ds_external_parameters()] == [engine.module[0].weight]
    assert copy.deepcopy(engine.module).ds_external_parameters() == []
    handles = list(offload.forward_hooks)
    offload._register_deepspeed_module(offload.module)  # twice: replaced, never doubled
    assert len(offload.forward_hooks) == len(handles)
    with pytest.raises(ValueError, match="engine's whole module"):
        offload._register_deepspeed_module(engine.module[0])
    engine.destroy()


def test_below_stage_3_there_is_no_parameter_offload():
    cfg = engine_config(2, False, 1, 2, 0.0, overlap=False)
    engine, *_ = zero_offload.initialize(model=_model(), config=cfg)
    assert not hasattr(engine.optimizer, "parameter_offload")
    engine.destroy()
