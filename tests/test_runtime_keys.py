"""DeepSpeed's top-level keys that change a step: ``managed_gradient_accumulation: false`` (the
caller's step() is the boundary), ``gradient_allreduce_op: "sum"``, and
``data_types.grad_accum_dtype`` (an fp32 accumulator for 16-bit params at stages 2/3)."""

from __future__ import annotations

import copy

import pytest
import torch
from distributed import run_ranks
from parity import (
    LR,
    WD,
    assert_partitioned_if_asked,
    batches,
    displacement_err,
    engine_config,
    make_model,
)

import zero_offload
from zero_offload.config import ConfigError
from zero_offload.runtime.engine.guards import EngineUsageError
from zero_offload.utils import safe_get_full_fp32_param, safe_get_full_grad

MICRO, GAS = 2, 2
COUNTS = [2, 3, 1]  # backwards per step(): differs per step and from the config's GAS
PLACEMENTS = [(0, False), (1, False), (1, True), (2, False), (2, True), (3, False), (3, True)]


def _config(stage: int, offload: bool, **top) -> dict:
    zero = {"stage3_param_persistence_threshold": 0} if stage == 3 else None
    cfg = engine_config(
        stage, offload, GAS, MICRO, 0.0, overlap=True, offload_param=offload and stage == 3,
        zero_extra=zero,
    )  # fmt: skip
    cfg.update(top)
    return cfg


def _micro_batches(world: int):
    ((x, y),) = batches(1, world, sum(COUNTS), MICRO)
    return x, y


def _reference(world: int):
    """Plain PyTorch: step k sums the loss of its COUNTS[k] micro-batches (each / GAS, as the
    engine's backward scales), over all ranks' rows."""
    model = make_model()
    init = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WD
    )
    x, y = _micro_batches(world)
    k = 0
    for count in COUNTS:
        opt.zero_grad()
        n = count * world * MICRO
        (model(x[k : k + n], y[k : k + n]) * count / GAS).backward()
        for p in model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
        k += n
    return init, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _unmanaged(stage: int, offload: bool, world: int = 1, rank: int = 0):
    model = make_model()
    engine, *_ = zero_offload.initialize(
        model=model, config=_config(stage, offload, managed_gradient_accumulation=False)
    )
    assert_partitioned_if_asked(model, _config(stage, offload))
    x, y = _micro_batches(world)
    k, applied = 0, []
    for count in COUNTS:
        for _ in range(count):
            lo = k + rank * MICRO
            engine.backward(engine(x[lo : lo + MICRO], y[lo : lo + MICRO]))
            assert not engine.is_gradient_accumulation_boundary()
            k += world * MICRO
        engine.step()
        applied.append(engine.was_step_applied())
    with pytest.raises(EngineUsageError, match="caller owns the boundary") as refused:
        engine.set_gradient_accumulation_boundary(True)
    assert isinstance(refused.value, AssertionError)  # DeepSpeed asserts it
    assert engine.managed_gradient_accumulation() is False
    out = {
        "params": {
            n: safe_get_full_fp32_param(p) for n, p in model.named_parameters() if p.requires_grad
        },
        "applied": applied,
        "steps": engine.global_steps,
        "samples": engine.global_samples,
    }
    engine.destroy()
    return out


@pytest.mark.parametrize("stage,offload", PLACEMENTS)
def test_unmanaged_accumulation_one_rank(stage, offload):
    init, ref = _reference(1)
    got = _unmanaged(stage, offload)
    assert got["applied"] == [True] * len(COUNTS) and got["steps"] == len(COUNTS)
    assert got["samples"] == sum(COUNTS) * MICRO
    assert displacement_err(got["params"], ref, init) < 1e-4


def _two_ranks():
    rank = zero_offload.comm.get_rank()
    return {(s, o): _unmanaged(s, o, 2, rank) for s, o in PLACEMENTS}


def test_unmanaged_accumulation_two_ranks():
    init, ref = _reference(2)
    for key, got in run_ranks(2, _two_ranks).items():
        assert got["samples"] == sum(COUNTS) * MICRO * 2, key
        assert displacement_err(got["params"], ref, init) < 1e-4, key


def _grads(op: str, stage: int):
    model = make_model()
    cfg = engine_config(stage, False, 1, MICRO, 0.0, overlap=False)
    cfg["gradient_allreduce_op"] = op
    engine, *_ = zero_offload.initialize(model=model, config=cfg)
    rank = zero_offload.comm.get_rank()
    ((x, y),) = batches(1, 2, 1, MICRO)
    lo = rank * MICRO
    engine.backward(engine(x[lo : lo + MICRO], y[lo : lo + MICRO]))
    out = {n: safe_get_full_grad(p) for n, p in model.named_parameters() if p.requires_grad}
    engine.step()
    engine.destroy()
    return out


def _sum_and_mean():
    return {(op, s): _grads(op, s) for op in ("mean", "sum") for s in (0, 1, 2)}


def test_gradient_allreduce_op_sum_sums_over_ranks():
    got = run_ranks(2, _sum_and_mean)
    for stage in (0, 1, 2):
        mean, total = got[("mean", stage)], got[("sum", stage)]
        for n in mean:
            assert torch.allclose(total[n], 2 * mean[n], rtol=1e-6, atol=1e-7), (stage, n)
    with pytest.raises(ConfigError, match="gradient_allreduce_op"):
        zero_offload.initialize(
            model=make_model(), config=_config(3, False, gradient_allreduce_op="sum")
        )


def _bf16_window_grads(engine, ref: torch.nn.Module, x, y, gas: int) -> dict:
    """The plain bf16 model, its weights the engine's: each micro-step's gradient (bf16, of
    loss/gas as the engine scales it) summed in fp32, micro-step by micro-step. An fp32
    accumulator holds this sum; a bf16 one rounds after every micro-step (~1e-3 of the norm)."""
    trained = {n: p for n, p in engine.module.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if n in trained:  # the engine's bf16 params are its fp32 master's cast
                p.copy_(safe_get_full_fp32_param(trained[n]))
    acc = {n: torch.zeros(p.shape, dtype=torch.float32) for n, p in ref.named_parameters()}
    for k in range(gas):
        ref.zero_grad(set_to_none=True)
        sl = slice(k * MICRO, (k + 1) * MICRO)
        (ref(x[sl], y[sl]) / gas).backward()
        for n, p in ref.named_parameters():
            if p.grad is not None:
                acc[n] += p.grad.float()
    return acc


@pytest.mark.parametrize("stage,offload", [(2, False), (2, True), (3, False), (3, True)])
def test_fp32_gradient_accumulation_for_bf16_params(stage, offload):
    """bf16 params, GAS 4: the accumulator is fp32 (get_data_types says so, and the window's
    gradient is the fp32 sum of the bf16 micro-step gradients, where a bf16 accumulator is off
    by ~1e-3 of the norm; with optimizer offload the fp32 host gradient holds that sum as it is).
    Stage 3 with every param partitioned."""
    gas = 4
    model = make_model()
    ref = make_model().to(torch.bfloat16)
    zero = {"stage3_param_persistence_threshold": 0} if stage == 3 else None
    cfg = engine_config(stage, offload, gas, MICRO, 0.0, overlap=True, zero_extra=zero)
    cfg["bf16"] = {"enabled": True}
    cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    engine, *_ = zero_offload.initialize(model=model, config=cfg)
    assert_partitioned_if_asked(model, cfg)
    assert engine.get_data_types() == (torch.bfloat16, torch.float32)
    assert all(
        gs.device_shard.dtype == torch.float32 for gs in (og.grads for og in engine.opt_groups)
    )
    for x, y in batches(2, 1, gas, MICRO):  # two windows: the accumulator restarts at zero
        want = _bf16_window_grads(engine, ref, x, y, gas)
        steps = engine.global_steps
        for k in range(gas):  # DeepSpeed's loop: step() after every backward
            sl = slice(k * MICRO, (k + 1) * MICRO)
            engine.backward(engine(x[sl], y[sl]))
            if k < gas - 1:
                engine.step()
        for n, p in engine.module.named_parameters():
            if not p.requires_grad:
                continue
            g, w = safe_get_full_grad(p).float(), want[n]
            # With offload too: the host gradient is fp32, the window's sum unrounded.
            assert float((g - w).norm()) <= 1e-6 * float(w.norm()), n
        engine.step()
        assert engine.global_steps == steps + 1  # the window ended in an optimizer step
    engine.destroy()
    # Stages 0/1 build an fp32 accumulator for bf16 params only (test_grad_accum_fp32_stage01);
    # any other accumulator there is refused by name.
    with pytest.raises(ConfigError, match='data_types.grad_accum_dtype.*"fp32" with bf16'):
        bad = copy.deepcopy(cfg)
        bad["zero_optimization"]["stage"] = 1
        bad["data_types"] = {"grad_accum_dtype": "fp16"}
        zero_offload.initialize(model=make_model(), config=bad)
