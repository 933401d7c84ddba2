"""Checkpoints with a client optimizer: its per-param state is saved per rank like the Adam
moments (elementwise state as shard tensors, scalars in meta.json), so a resume is bitwise the
run that never stopped, at every stage and placement, and loads at another world size; state
that is not elementwise is refused by key before anything is written."""

from __future__ import annotations

import pytest
import torch
from distributed import run_ranks
from parity import assert_partitioned_if_asked, batches, global_step, make_model
from test_client_optimizer import OPTIMIZERS, PLACEMENTS, _config

import zero_offload
from zero_offload.checkpoint import CheckpointError

KINDS = {
    **{k: v for k, v in OPTIMIZERS.items() if k in ("sgd", "custom")},
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05),  # elementwise "sum", scalar "step"
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5, centered=True),
}


def _engine(kind: str, stage: int, offload: bool, gas: int = 2):
    model = make_model()
    client = KINDS[kind]([p for p in model.parameters() if p.requires_grad])
    cfg = _config(stage, offload)
    cfg["gradient_accumulation_steps"] = gas
    engine = zero_offload.initialize(model=model, optimizer=client, config=cfg)[0]
    assert_partitioned_if_asked(model, cfg)  # stage 3: every param partitioned
    return engine


def _params(engine) -> dict:
    from zero_offload.utils import safe_get_full_fp32_param

    return {
        n: safe_get_full_fp32_param(p).clone()
        for n, p in engine.module.named_parameters()
        if p.requires_grad
    }


def _resume(kind: str, stage: int, offload: bool, root: str, world: int = 1, rank: int = 0):
    """(losses and params of a run that saved after 2 steps and went on for 2, the same of a
    fresh engine that loaded that checkpoint and went on)."""
    steps = batches(4, world, 2, 2)
    engine = _engine(kind, stage, offload)
    for x, y in steps[:2]:
        global_step(engine, x, y, world, rank)
    engine.save_checkpoint(root, tag="t")
    straight = [global_step(engine, x, y, world, rank) for x, y in steps[2:]]
    want = _params(engine)
    engine.destroy()
    fresh = _engine(kind, stage, offload)
    fresh.load_checkpoint(root, tag="t")
    resumed = [global_step(fresh, x, y, world, rank) for x, y in steps[2:]]
    got = _params(fresh)
    fresh.destroy()
    return (straight, want), (resumed, got)


@pytest.mark.parametrize("stage,offload", PLACEMENTS)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_resume_with_a_client_optimizer_is_bitwise(kind, stage, offload, tmp_path):
    (straight, want), (resumed, got) = _resume(kind, stage, offload, str(tmp_path))
    assert resumed == straight
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def _two_ranks(root: str) -> tuple:
    rank = zero_offload.comm.get_rank()
    out = _resume("sgd", 2, True, root, world=2, rank=rank)
    torch.distributed.barrier()
    return out


def test_two_ranks_resume_bitwise_and_load_elastically_at_one(tmp_path):
    (straight, want), (resumed, got) = run_ranks(2, _two_ranks, str(tmp_path))
    assert resumed == straight
    assert all(torch.equal(got[n], v) for n, v in want.items())
    # The same checkpoint at one rank (twice the accumulation: the same global batch): the
    # momentum is resliced, the continuation is the two-rank one up to the gradient sum's order.
    steps = batches(4, 2, 2, 2)
    engine = _engine("sgd", 2, True, gas=4)
    engine.load_checkpoint(str(tmp_path), tag="t")
    sgd = engine.opt_groups[0].optimizer.client.optimizer
    assert sgd.state[engine.opt_groups[0].optimizer.client.param]["momentum_buffer"].abs().sum() > 0
    for x, y in steps[2:]:
        global_step(engine, x, y, 1, 0)
    one = _params(engine)
    engine.destroy()
    for name, value in want.items():
        assert torch.allclose(one[name], value, atol=1e-6), name


class Shaped(torch.optim.Optimizer):
    """State that is not elementwise: a per-group statistic of two numbers."""

    def __init__(self, params) -> None:
        super().__init__(params, {"lr": 1e-2})

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                self.state[p]["stats"] = torch.stack([p.grad.mean(), p.grad.std()])
                p.add_(p.grad, alpha=-g["lr"])


def test_state_that_is_not_elementwise_is_refused_by_key(tmp_path):
    model = make_model()
    client = Shaped([p for p in model.parameters() if p.requires_grad])
    engine = zero_offload.initialize(model=model, optimizer=client, config=_config(2, False))[0]
    x, y = batches(1, 1, 2, 2)[0]
    global_step(engine, x, y)
    with pytest.raises(CheckpointError, match=r"Shaped.*'stats'.*neither elementwise"):
        engine.save_checkpoint(str(tmp_path))
    assert not any(tmp_path.iterdir())
    engine.destroy()


def test_optimizer_kind_mismatch_is_named(tmp_path):
    engine = _engine("sgd", 1, False)
    x, y = batches(1, 1, 2, 2)[0]
    global_step(engine, x, y)
    engine.save_checkpoint(str(tmp_path), tag="t")
    engine.destroy()
    other = _engine("adagrad", 1, False)
    with pytest.raises(CheckpointError, match="client optimizer SGD's state, the engine runs"):
        other.load_checkpoint(str(tmp_path), tag="t")
    other.load_checkpoint(str(tmp_path), tag="t", load_optimizer_states=False)  # weights alone
    other.destroy()
