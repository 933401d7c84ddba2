"""Activation checkpointing (torch.utils.checkpoint, reentrant and not; deepspeed.checkpointing's
with cpu_checkpointing on two ranks) with frozen and trainable params mixed, against plain
PyTorch on the same global batch, at every stage and on 1 and 2 ranks.

Reentrant recomputation runs each block's backward as a nested autograd graph task; the engine's
"end of backward" must be the end of the outermost one. Before that was so, three checkpointed
blocks with a frozen LayerNorm gave a global grad norm of 1.418 where PyTorch gives 1.034 at
stages 0/1, and a middle block's gradient was lost on two ranks.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.utils.checkpoint as cp
from parity import displacement_err, engine_config, grad_rel_err

from zero_offload import activation_checkpointing as ac

D, BLOCKS, MICRO, GAS, STEPS, CLIP = 16, 3, 2, 2, 3, 1.0
LR, WD = 1e-2, 0.01


class Block(torch.nn.Module):
    def __init__(self, frozen_norm: bool) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(D)
        self.fc = torch.nn.Linear(D, D)
        self.norm.requires_grad_(not frozen_norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(self.norm(x)))


class Stack(torch.nn.Module):
    """Checkpointed blocks (the middle one's LayerNorm trainable, the others' frozen), then
    optionally a trainable head outside any checkpoint."""

    def __init__(self, reentrant: bool | str | None, input_grad: bool, head: bool) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(frozen_norm=i != 1) for i in range(BLOCKS))
        self.head = torch.nn.Linear(D, D) if head else None
        self.reentrant, self.input_grad = reentrant, input_grad

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.input_grad:
            x = x.detach().requires_grad_(True)
        for b in self.blocks:
            if self.reentrant is None:
                x = b(x)
            elif self.reentrant == "deepspeed":  # deepspeed.checkpointing's, as configured
                x = ac.checkpoint(b, x)
            else:
                x = cp.checkpoint(b, x, use_reentrant=self.reentrant)
        if self.head is not None:
            x = self.head(x)
        return (x - y).square().mean()


def _model(variant: dict) -> Stack:
    torch.manual_seed(0)
    return Stack(**variant)


def _data(world: int):
    g = torch.Generator().manual_seed(1)
    n = world * GAS * MICRO
    return [(torch.randn(n, D, generator=g), torch.randn(n, D, generator=g)) for _ in range(STEPS)]


def _reference(variant: dict, world: int):
    """Plain PyTorch on the whole global batch; a param that got no gradient (the first block's
    under reentrant checkpointing of an input that needs none) steps on zeros, as the engine's
    reduction of an unused param does."""
    model = _model(variant)
    init = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=LR, weight_decay=WD)
    grads, norms = [], []
    for x, y in _data(world):
        opt.zero_grad()
        model(x, y).backward()
        for p in trainable:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
        norms.append(float(torch.nn.utils.clip_grad_norm_(trainable, CLIP)))
        opt.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return init, params, grads, norms


def _engine_run(variant: dict, cfg: dict, world: int = 1, rank: int = 0, plain: bool = False):
    """This rank's share of every global batch; ``plain``: ``loss.backward()`` instead of
    ``engine.backward(loss)``."""
    import zero_offload
    from zero_offload.utils import safe_get_full_fp32_param, safe_get_full_grad

    model = _model(variant)
    engine, *_ = zero_offload.initialize(model=model, config=copy.deepcopy(cfg))
    if cfg["zero_optimization"]["stage"] == 3:
        assert all(p.numel() == 0 for p in model.parameters())  # partitioned, every one
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    grads, norms = [], []
    for x, y in _data(world):
        for k in range(GAS):
            lo = (k * world + rank) * MICRO
            loss = engine(x[lo : lo + MICRO], y[lo : lo + MICRO])
            if plain:
                loss.backward()
            else:
                engine.backward(loss)
            if engine.is_gradient_accumulation_boundary():
                grads.append({n: safe_get_full_grad(p).clone() for n, p in named.items()})
            engine.step()
        norms.append(engine.get_global_grad_norm())
    params = {n: safe_get_full_fp32_param(p).clone() for n, p in named.items()}
    engine.destroy()
    return params, grads, norms


def _config(stage: int, offload: bool) -> dict:
    cfg = engine_config(
        stage,
        offload,
        GAS,
        MICRO,
        CLIP,
        overlap=True,
        bucket=40,  # several buckets: one per block or less, so an early end shows
        offload_param=offload and stage == 3,
        zero_extra={"stage3_param_persistence_threshold": 0} if stage == 3 else None,
    )
    cfg["optimizer"]["params"].update(lr=LR, weight_decay=WD)
    return cfg


def _check(variant: dict, world: int, got) -> None:
    init, ref_params, ref_grads, ref_norms = _reference(variant, world)
    params, grads, norms = got
    assert max(grad_rel_err(g, r) for g, r in zip(grads, ref_grads)) < 1e-5
    assert norms == pytest.approx(ref_norms, rel=1e-5)
    assert displacement_err(params, ref_params, init) < 1e-3


PLACEMENTS = [(0, False), (1, False), (2, False), (2, True), (3, False), (3, True)]


@pytest.mark.parametrize("stage,offload", PLACEMENTS)
@pytest.mark.parametrize("reentrant", [True, False, None], ids=["reentrant", "saved", "none"])
@pytest.mark.parametrize("input_grad", [True, False], ids=["input-grad", "input-data"])
def test_checkpointed_blocks_match_plain_pytorch(stage, offload, reentrant, input_grad):
    # Without an input that needs grad, reentrant blocks give their params no gradient (as in
    # PyTorch): the head keeps the loss differentiable.
    variant = {"reentrant": reentrant, "input_grad": input_grad, "head": not input_grad}
    _check(variant, 1, _engine_run(variant, _config(stage, offload)))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_checkpointed_blocks_with_a_head_and_plain_backward(stage):
    """A trainable head outside the checkpoints (its gradient comes first, in the outer task),
    driven by a plain loss.backward()."""
    variant = {"reentrant": True, "input_grad": True, "head": True}
    _check(variant, 1, _engine_run(variant, _config(stage, stage >= 2), plain=True))


def _two_ranks():
    import zero_offload

    rank = zero_offload.comm.get_rank()
    out = []
    for stage, offload in PLACEMENTS:
        for input_grad in (True, False):
            variant = {"reentrant": True, "input_grad": input_grad, "head": not input_grad}
            out.append((variant, _engine_run(variant, _config(stage, offload), 2, rank)))
    return out


def test_reentrant_checkpointing_on_two_ranks_matches_plain_pytorch():
    from distributed import run_ranks

    for variant, got in run_ranks(2, _two_ranks):
        _check(variant, 2, got)


def _two_ranks_deepspeed_api():
    """deepspeed.checkpointing's checkpoint with the config's cpu_checkpointing (applied by the
    engine): its inputs on the host, the recompute's nested backward reduced with the rest."""
    import zero_offload

    rank = zero_offload.comm.get_rank()
    out = []
    for stage, offload in ((2, True), (3, False)):
        cfg = _config(stage, offload)
        cfg["activation_checkpointing"] = {"cpu_checkpointing": True}
        variant = {"reentrant": "deepspeed", "input_grad": True, "head": False}
        out.append((variant, _engine_run(variant, cfg, 2, rank)))
        assert ac.policy().cpu_checkpointing and ac.COUNTERS.peak["host"] > 0
    return out


def test_deepspeed_checkpointing_with_cpu_checkpointing_on_two_ranks():
    from distributed import run_ranks

    for variant, got in run_ranks(2, _two_ranks_deepspeed_api):
        _check({**variant, "reentrant": None}, 2, got)  # the reference: no checkpoint at all
