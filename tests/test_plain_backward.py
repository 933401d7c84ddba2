"""A plain ``loss.backward()`` on the engine's output (DeepSpeed's torch-style backward), then
``engine.step()``: the same training as ``engine.backward(loss)`` at every stage and placement,
on 1 and 2 ranks; with fp16 it needs ``engine.scale(loss)`` and says so otherwise."""

from __future__ import annotations

import pytest
import torch
from distributed import run_ranks
from parity import displacement_err, engine_config, make_model, run_cases

import zero_offload
from zero_offload.runtime.engine.guards import EngineUsageError

GRAD_TOL, PARAM_TOL = 1e-5, 1e-3
THRESHOLD_0 = {"stage3_param_persistence_threshold": 0}


def _cases() -> list[dict]:
    out = []
    for stage, offload, offload_param in [
        (0, False, False),
        (1, False, False),
        (1, True, False),
        (2, False, False),
        (2, True, False),
        (3, False, False),
        (3, True, True),
    ]:
        extra = {"offload_param": offload_param}
        if stage == 3:
            extra["zero_extra"] = THRESHOLD_0
        out.append(
            dict(stage=stage, offload=offload, gas=2, clip=0.05, overlap=True, plain=True, **extra)
        )
    return out


def _check(results: list[dict]) -> None:
    for r in results:
        assert r["grad_err"] < GRAD_TOL, r["case"] | {"grad_err": r["grad_err"]}
        assert r["param_err"] < PARAM_TOL, r["case"] | {"param_err": r["param_err"]}


def test_plain_backward_matches_plain_pytorch_one_rank():
    _check(run_cases(_cases()))


def test_plain_backward_matches_plain_pytorch_two_ranks():
    _check(run_ranks(2, run_cases, _cases()))


def _engine(**cfg_extra):
    cfg = engine_config(2, False, 2, 2, 0.0, overlap=False, **cfg_extra)
    engine, *_ = zero_offload.initialize(model=make_model(), config=cfg)
    x = torch.randint(0, 32, (2, 5))
    return engine, x


def test_fp16_plain_backward_without_scale_is_refused_before_any_gradient():
    engine, x = _engine(dtype="fp16")
    with pytest.raises(EngineUsageError, match=r"engine\.scale\(loss\)\.backward\(\)"):
        engine(x, x).backward()
    assert all(p.grad is None for p in engine.module.parameters())
    engine.scale(engine(x, x)).backward()  # then the scaled one goes through
    engine.step()
    engine.destroy()


def test_fp16_scaled_plain_backward_equals_engine_backward():
    results = run_cases(
        [
            dict(stage=2, offload=True, gas=2, clip=0.05, overlap=True, dtype="fp16", plain=p)
            for p in (False, True)
        ]
    )
    a, b = results
    assert b["losses"] == a["losses"]
    # 1/GAS applied to the scaled loss or to the fp16 gradient: equal but for subnormals
    assert displacement_err(b["params"], a["params"], a["init"]) < 1e-5


def test_plain_backward_keeps_the_engine_checks():
    engine, x = _engine()
    engine(x, x).backward()  # micro-step 1 of 2 accumulates
    engine.step()
    engine(x, x).backward()  # the boundary: reduces
    engine(x, x).backward()  # another one before step(): adds to the reduced gradient
    engine.step()
    with pytest.raises(EngineUsageError, match="no engine.backward"):
        engine.step()
    engine.destroy()


def test_backward_of_the_module_called_directly_still_reduces():
    """A forward through ``engine.module`` has no output hooks; the first gradient hook opens
    the backward instead (same result without reentrant checkpointing)."""
    ref, _ = _engine()
    got, x = _engine()
    for _ in range(2):
        ref.backward(ref(x, x))
        ref.step()
        got.module(x, x).backward()
        got.step()
    a = [p.detach().clone() for p in ref.module.parameters()]
    b = [p.detach().clone() for p in got.module.parameters()]
    assert all(torch.allclose(u, v, rtol=0, atol=1e-6) for u, v in zip(a, b))
    assert ref.global_steps == got.global_steps == 1
    ref.destroy()
    got.destroy()
