"""Client optimizers (``initialize(optimizer=...)``) and engines without one.

Any elementwise ``torch.optim.Optimizer`` (SGD with momentum, torch Adam with amsgrad, a custom
class) trains like the same optimizer in plain PyTorch on the same global batch, at every stage
and placement, on 1 and 2 ranks; torch Adam/AdamW and this project's DeepSpeedCPUAdam map onto
the built-in Adam(W). Without any optimizer the engine runs forward only (inference, a frozen
reference model as TRL's DPO prepares it) and refuses to train.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from distributed import run_ranks
from parity import (
    assert_partitioned_if_asked,
    batches,
    displacement_err,
    engine_config,
    make_model,
)

import zero_offload
from zero_offload.config import ConfigError
from zero_offload.ops.adam import DeepSpeedCPUAdam
from zero_offload.runtime.engine.guards import NoOptimizerError

STEPS, MICRO, GAS = 3, 2, 2
PLACEMENTS = [(0, False), (1, False), (1, True), (2, False), (2, True), (3, False), (3, True)]


class SignMomentum(torch.optim.Optimizer):
    """A custom elementwise optimizer: momentum of the gradient's sign."""

    def __init__(self, params, lr: float = 1e-2, beta: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "beta": beta})

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("buf", torch.zeros_like(p))
                buf.mul_(g["beta"]).add_(torch.sign(p.grad))
                p.add_(buf, alpha=-g["lr"])


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    "custom": lambda ps: SignMomentum(ps, lr=1e-3),
    "cpu-adam": lambda ps: DeepSpeedCPUAdam(ps, lr=1e-2, weight_decay=0.01),
}
REFERENCE = {  # plain PyTorch's version of each
    **OPTIMIZERS,
    "cpu-adam": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01),
}


def _config(stage: int, offload: bool) -> dict:
    cfg = engine_config(
        stage,
        offload,
        GAS,
        MICRO,
        0.0,
        overlap=True,
        offload_param=offload and stage == 3,
        zero_extra={"stage3_param_persistence_threshold": 0} if stage == 3 else None,
    )
    del cfg["optimizer"]
    return cfg


def _reference(kind: str, world: int):
    model = make_model()
    init = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    opt = REFERENCE[kind]([p for p in model.parameters() if p.requires_grad])
    for x, y in batches(STEPS, world, GAS, MICRO):
        opt.zero_grad()
        model(x, y).backward()
        for p in model.parameters():  # the engine reduces an unused param's gradient as zeros
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
    return init, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _train(kind: str, stage: int, offload: bool, world: int = 1, rank: int = 0):
    from zero_offload.utils import safe_get_full_fp32_param

    model = make_model()
    client = OPTIMIZERS[kind]([p for p in model.parameters() if p.requires_grad])
    engine, *_ = zero_offload.initialize(
        model=model, optimizer=client, config=_config(stage, offload)
    )
    assert_partitioned_if_asked(model, _config(stage, offload))
    for x, y in batches(STEPS, world, GAS, MICRO):
        for k in range(GAS):
            lo = (k * world + rank) * MICRO
            engine.backward(engine(x[lo : lo + MICRO], y[lo : lo + MICRO]))
            engine.step()
    out = {
        n: safe_get_full_fp32_param(p).clone()
        for n, p in model.named_parameters()
        if p.requires_grad
    }
    native = engine.opt_groups[0].optimizer.client is None
    engine.destroy()
    return out, native


@pytest.mark.parametrize("stage,offload", PLACEMENTS)
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_client_optimizer_matches_plain_pytorch(kind, stage, offload):
    init, ref = _reference(kind, 1)
    got, native = _train(kind, stage, offload)
    assert native == (kind == "cpu-adam")  # only the Adam family runs as the built-in Adam
    assert displacement_err(got, ref, init) < 1e-4


def _two_ranks():
    rank = zero_offload.comm.get_rank()
    return {
        (kind, stage, offload): _train(kind, stage, offload, 2, rank)[0]
        for kind in ("sgd", "custom")
        for stage, offload in PLACEMENTS
        if stage > 0
    }


def test_client_optimizer_on_two_ranks_matches_plain_pytorch():
    refs = {kind: _reference(kind, 2) for kind in ("sgd", "custom")}
    for (kind, stage, offload), got in run_ranks(2, _two_ranks).items():
        init, ref = refs[kind]
        assert displacement_err(got, ref, init) < 1e-4, (kind, stage, offload)


def test_lr_scheduler_reaches_the_client_optimizer():
    model, ref = make_model(), make_model()
    client = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    engine, opt, _, sched = zero_offload.initialize(
        model=model,
        optimizer=client,
        config=_config(2, True),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.5**s),
    )
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 0.5**s)
    for x, y in batches(STEPS, 1, 1, MICRO * GAS):
        for k in range(GAS):
            engine.backward(engine(x[k * MICRO : (k + 1) * MICRO], y[k * MICRO : (k + 1) * MICRO]))
            engine.step()
        ref_opt.zero_grad()
        ref(x, y).backward()
        ref_opt.step()
        ref_sched.step()
    assert engine.get_lr() == pytest.approx([0.1 * 0.5**STEPS])
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p.detach(), q.detach(), atol=1e-6)


def test_client_optimizer_wins_over_the_config_block_with_a_warning(caplog):
    model = make_model()
    cfg = _config(1, False)
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    client = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with caplog.at_level(logging.WARNING, logger="zero_offload"):
        engine, *_ = zero_offload.initialize(model=model, optimizer=client, config=cfg)
    assert "using the client optimizer" in caplog.text and "SGD" in caplog.text
    assert engine.opt_groups[0].optimizer.client is not None and engine.get_lr() == [0.1]
    engine.destroy()


def test_client_optimizer_limits_are_clear_errors(tmp_path):
    model = make_model()
    cfg = _config(2, True)
    cfg["zero_optimization"]["offload_optimizer"]["delayed_update"] = True
    sgd = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with pytest.raises(ConfigError, match="delayed_update"):
        zero_offload.initialize(model=model, optimizer=sgd, config=cfg)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_engine_without_an_optimizer_runs_forward_only(stage, tmp_path):
    model, plain = make_model(), make_model()
    engine, opt, _, sched = zero_offload.initialize(model=model, config=_config(stage, False))
    assert opt is None and sched is None
    if stage == 3:
        assert all(p.numel() == 0 for p in model.parameters())
    x, y = batches(1, 1, 1, 4)[0]
    with torch.no_grad():
        assert float(engine(x, y)) == pytest.approx(float(plain(x, y)), rel=1e-6)
    loss = engine(x, y)
    with pytest.raises(NoOptimizerError, match="no optimizer") as err:
        engine.backward(loss)
    assert isinstance(err.value, AssertionError)  # DeepSpeed asserts here
    with pytest.raises(NoOptimizerError):
        loss.backward()
    with pytest.raises(NoOptimizerError):
        engine.step()
    engine.destroy()


def test_frozen_reference_model_as_trl_prepares_it():
    """TRL's DPO: a frozen copy of the policy through initialize() with the policy's config
    (optimizer block included), then eval forwards."""
    policy = make_model()
    ref = copy.deepcopy(policy).requires_grad_(False)
    cfg = engine_config(2, True, 1, 4, 1.0, overlap=True)
    engine, opt, *_ = zero_offload.initialize(model=ref, config=copy.deepcopy(cfg))
    engine.eval()
    x, y = batches(1, 1, 1, 4)[0]
    with torch.no_grad():
        assert float(engine(x, y)) == pytest.approx(float(policy(x, y)), rel=1e-6)
    assert opt is None
    engine.destroy()
