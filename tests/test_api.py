"""The DeepSpeed-compatible surface: initialize's arguments, param groups, client optimizers,
schedulers, counters and accessors."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from parity import (
    BETAS,
    EPS,
    LR,
    batches,
    displacement_err,
    engine_config,
    make_model,
    reference_step,
)

import zero_offload


def test_initialize_from_args_and_counters(tmp_path):
    cfg = engine_config(stage=2, offload=False, gas=2, micro=2, clip=1.0, overlap=False)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    parser = zero_offload.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    engine, opt, loader, sched = zero_offload.initialize(args=args, model=make_model())
    assert loader is None and sched is None and isinstance(opt, torch.optim.Optimizer)
    assert (
        engine.train_micro_batch_size_per_gpu() == 2 and engine.gradient_accumulation_steps() == 2
    )
    assert engine.train_batch_size() == 4 and engine.world_size == 1 and engine.global_rank == 0
    assert engine.device == torch.device("cpu") and engine.get_lr() == [LR]
    ((x, y),) = batches(1, 1, 2, 2)
    flags = []
    for k in range(2):
        flags.append(engine.is_gradient_accumulation_boundary())
        engine.backward(engine(x[2 * k : 2 * k + 2], y[2 * k : 2 * k + 2]))
        engine.step()
    assert flags == [False, True]
    assert engine.micro_steps == 2 and engine.global_steps == 1
    assert engine.get_global_grad_norm() > 0
    with pytest.raises(RuntimeError, match="engine.step"):
        opt.step()


def test_param_groups_without_weight_decay_match_torch():
    model = make_model()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and p.requires_grad]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 and p.requires_grad]
    groups = [{"params": decay, "weight_decay": 0.5}, {"params": no_decay, "weight_decay": 0.0}]
    cfg = engine_config(stage=2, offload=True, gas=1, micro=2, clip=0.0, overlap=True)
    engine, opt, _, _ = zero_offload.initialize(model=model, model_parameters=groups, config=cfg)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.5, 0.0]

    ref = make_model()
    init = {n: p.detach().clone() for n, p in ref.named_parameters()}
    rd = [p for n, p in ref.named_parameters() if p.ndim >= 2 and p.requires_grad]
    rn = [p for n, p in ref.named_parameters() if p.ndim < 2 and p.requires_grad]
    ropt = torch.optim.AdamW(
        [{"params": rd, "weight_decay": 0.5}, {"params": rn, "weight_decay": 0.0}],
        lr=LR,
        betas=BETAS,
        eps=EPS,
    )
    for x, y in batches(3, 1, 1, 2):
        engine.backward(engine(x, y))
        engine.step()
        reference_step(ref, ropt, x, y)
    got = {n: p.detach().float() for n, p in model.named_parameters()}
    want = {n: p.detach() for n, p in ref.named_parameters()}
    assert displacement_err(got, want, init) < 1e-3


def test_client_torch_optimizer_and_errors():
    model = make_model()
    client = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.1
    )
    cfg = engine_config(stage=1, offload=False, gas=1, micro=2, clip=0.0, overlap=False)
    del cfg["optimizer"]
    engine, opt, _, _ = zero_offload.initialize(model=model, optimizer=client, config=cfg)
    assert engine.get_lr() == [3e-3] and opt.param_groups[0]["weight_decay"] == 0.1
    assert engine.opt_groups[0].optimizer.client is None  # torch AdamW runs as the built-in AdamW
    # Other client optimizers, and a client optimizer beside a config block: test_client_optimizer
    with pytest.raises(ValueError, match="config"):
        zero_offload.initialize(model=make_model())
    with pytest.raises(ValueError, match="model"):
        zero_offload.initialize(config=cfg)


def test_config_scheduler_drives_lr_and_dataloader():
    cfg = engine_config(stage=0, offload=False, gas=1, micro=3, clip=0.0, overlap=False)
    cfg["scheduler"] = {
        "type": "WarmupLR",
        "params": {
            "warmup_min_lr": 0.0,
            "warmup_max_lr": LR,
            "warmup_num_steps": 4,
            "warmup_type": "linear",
        },
    }
    data = [(torch.randint(0, 32, (5,)), torch.randint(0, 32, (5,))) for _ in range(12)]
    engine, opt, loader, sched = zero_offload.initialize(
        model=make_model(), config=cfg, training_data=data
    )
    assert sched is not None and engine.lr_scheduler is sched
    lrs = []
    for x, y in loader:
        assert x.shape == (3, 5)
        engine.backward(engine(x, y))
        engine.step()
        lrs.append(engine.get_lr()[0])
    assert len(lrs) == 4 and lrs == sorted(lrs) and lrs[0] < lrs[-1] <= LR


def test_module_zero_grad_between_steps_is_harmless():
    """A user calling model.zero_grad() (set_to_none) must not break the stage 0/1 grad views."""
    cfg = engine_config(stage=1, offload=False, gas=1, micro=2, clip=0.0, overlap=False)
    model = make_model()
    engine, *_ = zero_offload.initialize(model=model, config=cfg)
    ref = make_model()
    init = {n: p.detach().clone() for n, p in ref.named_parameters()}
    ropt = torch.optim.AdamW(
        [p for p in ref.parameters() if p.requires_grad],
        lr=LR,
        betas=BETAS,
        eps=EPS,
        weight_decay=0.01,
    )
    for x, y in batches(3, 1, 1, 2):
        model.zero_grad()
        engine.backward(engine(x, y))
        engine.step()
        reference_step(ref, ropt, x, y)
    got = {n: p.detach().float() for n, p in model.named_parameters()}
    assert displacement_err(got, {n: p.detach() for n, p in ref.named_parameters()}, init) < 1e-3


def test_allgather_partitions_false_and_unused_parameter_policy():
    from distributed import run_ranks

    assert run_ranks(2, _broadcast_and_unused) == "ok"


def _broadcast_and_unused():
    from parity import run_cases

    r = run_cases([dict(stage=2, offload=True, gas=1, clip=0.0, overlap=True)])[0]
    cfg = engine_config(stage=1, offload=False, gas=1, micro=2, clip=0.0, overlap=True)
    cfg["zero_optimization"]["allgather_partitions"] = False
    base = run_cases([dict(stage=1, offload=False, gas=1, clip=0.0, overlap=True)])[0]
    model = make_model()
    engine, *_ = zero_offload.initialize(model=model, config=cfg)
    from zero_offload.core import dist

    for x, y in batches(4, 2, 1, 2):
        r0 = dist.rank() * 2
        engine.backward(engine(x[r0 : r0 + 2], y[r0 : r0 + 2]))
        engine.step()
    got = {n: p.detach().float() for n, p in model.named_parameters()}
    # Broadcasting each rank's slices gives the same training as all-gathering them.
    assert r["param_err"] < 1e-3 and displacement_err(got, base["params"], base["init"]) < 1e-3
    cfg["zero_optimization"]["ignore_unused_parameters"] = False
    engine, *_ = zero_offload.initialize(model=make_model(), config=cfg)
    x, y = batches(1, 2, 1, 2)[0]
    with pytest.raises(RuntimeError, match="unused.weight"):
        engine.backward(engine(x[:2], y[:2]))
    return "ok"
