"""``data_types.grad_accum_dtype: "fp32"`` with bf16 params at ZeRO stages 0 and 1 (DeepSpeed's
BF16_Optimizer): each micro-step's bf16 ``p.grad`` is added into an fp32 flat accumulator, the
boundary reduces the fp32 sums and the update reads them unrounded. The reference is plain
PyTorch: a bf16 model whose ``p.grad`` hooks add each micro-batch gradient into fp32 buffers,
then AdamW on fp32 masters. A bf16-accumulated run differs from it measurably."""

from __future__ import annotations

import pytest
import torch
from distributed import run_ranks
from parity import BETAS, LR, WD, batches, displacement_err, engine_config, make_model

MICRO, GAS, STEPS = 2, 4, 2
EPS_LINEAR = 1.0  # Adam's update ~ lr * gradient (not lr * sign): a rounded gradient shows


def _config(stage: int, offload: bool, fp32_accum: bool, clip: float = 0.0) -> dict:
    cfg = engine_config(stage, offload, GAS, MICRO, clip, overlap=True, dtype="bf16")
    cfg["optimizer"]["params"]["eps"] = EPS_LINEAR
    if fp32_accum:
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    return cfg


def _train(cfg: dict) -> tuple:
    """This rank's share of each global batch, DeepSpeed's loop (step() after each backward);
    returns (final masters, the reference's, memory report and expectation, initial masters,
    the boundary steps' global gradient norms)."""
    # The reference runs here, with the rank's thread count: bf16 matmuls round by it.
    import zero_offload
    from zero_offload.core import dist
    from zero_offload.utils import safe_get_full_fp32_param

    world, rank = dist.world_size(), dist.rank()
    engine, *_ = zero_offload.initialize(model=make_model(), config=cfg)
    named = {n: p for n, p in engine.module.named_parameters() if p.requires_grad}
    masters = lambda: {n: safe_get_full_fp32_param(p).clone() for n, p in named.items()}  # noqa: E731
    init, norms = masters(), []
    for x, y in batches(STEPS, world, GAS, MICRO):
        for k in range(GAS):
            lo = (k * world + rank) * MICRO
            engine.backward(engine(x[lo : lo + MICRO], y[lo : lo + MICRO]))
            engine.step()
        norms.append(float(engine.get_global_grad_norm()))
    mem = {"have": engine.memory_report(), "want": engine.expected_memory()}
    clip = cfg["gradient_clipping"]
    ref = _reference(init, world, clip) if rank == 0 else None
    out = (masters(), ref, mem, init, norms)
    engine.destroy()
    return out


def _reference(init: dict, world: int, clip: float) -> tuple[dict, list[float]]:
    """bf16 forward/backward per micro-batch (of loss / (GAS * world), as the engine scales
    and averages it), ``p.grad`` hooks adding into fp32 buffers, clipping by the fp32 sums'
    norm, AdamW on the fp32 masters; the masters and each step's norm."""
    lp = make_model().to(torch.bfloat16)
    masters = {n: init[n].clone() for n in init}
    params = [torch.nn.Parameter(masters[n]) for n in init]
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS_LINEAR, weight_decay=WD)
    acc = {n: torch.zeros_like(init[n]) for n in init}
    norms: list[float] = []
    named = dict(lp.named_parameters())

    def into_fp32(name: str):
        def hook(p: torch.Tensor) -> None:
            acc[name].add_(p.grad.float())
            p.grad = None  # the next micro-batch's bf16 gradient starts from zero

        return hook

    for n in init:
        named[n].register_post_accumulate_grad_hook(into_fp32(n))
    for x, y in batches(STEPS, world, GAS, MICRO):
        with torch.no_grad():
            for n, p in zip(init, params):
                named[n].copy_(p)
        for a in acc.values():
            a.zero_()
        for k in range(GAS):
            for r in range(world):
                lo = (k * world + r) * MICRO
                (lp(x[lo : lo + MICRO], y[lo : lo + MICRO]) / (GAS * world)).backward()
        for n, p in zip(init, params):
            p.grad = acc[n].clone()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip if clip else float("inf"))))
        opt.step()
    return {n: p.detach() for n, p in zip(init, params)}, norms


CASES = [(0, False, 1), (1, False, 1), (1, True, 1), (0, False, 2), (1, False, 2), (1, True, 2)]
CLIPPED = [(1, False, 2), (1, True, 2)]  # clip below the norm (~9): the factor is from fp32 sums


# Two ranks without offload and without clipping: the clipped two-rank cases cover them
# (the slow sweep runs them too).
SLOW = {"s0-w2", "s1-w2"}
IDS = ["s0-w1", "s1-w1", "s1-offload-w1", "s0-w2", "s1-w2", "s1-offload-w2"]


@pytest.mark.parametrize(
    "stage,offload,world,clip",
    [
        pytest.param(*c, 0.0, id=i, marks=[pytest.mark.slow] if i in SLOW else [])
        for c, i in zip(CASES, IDS, strict=True)
    ]
    + [
        pytest.param(*c, 4.0, id=i)
        for c, i in zip(CLIPPED, ["s1-w2-clip", "s1-offload-w2-clip"], strict=True)
    ],
)
def test_fp32_accumulator_matches_fp32_summed_reference(stage, offload, world, clip):
    fp32_run, (ref, ref_norms), mem, init, norms = run_ranks(
        world, _train, _config(stage, offload, True, clip)
    )
    bf16_run, *_ = run_ranks(world, _train, _config(stage, offload, False, clip))
    assert clip == 0 or min(ref_norms) > 2 * clip  # clipping acts
    # The norm is the fp32 sums' (a bf16-accumulated gradient's is ~1e-3 off).
    assert all(abs(a - b) <= 1e-5 * b for a, b in zip(norms, ref_norms)), (norms, ref_norms)
    # The memory report counts the fp32 flat accumulator, as the formula predicts.
    assert mem["have"]["device.grad_accum"] == mem["want"]["device.grad_accum"] > 0
    err, bf16_err = displacement_err(fp32_run, ref, init), displacement_err(bf16_run, ref, init)
    assert err < 1e-4, err
    assert bf16_err > max(20 * err, 2e-4), (bf16_err, err)
