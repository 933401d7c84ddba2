"""zero_offload.ops.adam: DeepSpeedCPUAdam over the host kernel, and FusedAdam over torch's."""

from __future__ import annotations

import copy

import pytest
import torch

from zero_offload.ops.adam import DeepSpeedCPUAdam, FusedAdam

SIZES = (1, 7, 33, 1031)  # odd sizes: SIMD tails of every width


def _reference(p0, grads, lr, betas, eps, wd, adamw, bias_correction):
    """Adam(W) in float64, written from the papers' formulas (DeepSpeed's variant: eps outside
    the bias-corrected sqrt)."""
    p = p0.double().clone()
    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    b1, b2 = betas
    for t, g in enumerate(grads, 1):
        g = g.double()
        if not adamw and wd:
            g = g + wd * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        bc1 = 1 - b1**t if bias_correction else 1.0
        bc2 = 1 - b2**t if bias_correction else 1.0
        if adamw and wd:
            p = p * (1 - lr * wd)
        p = p - lr / bc1 * m / (v.sqrt() / bc2**0.5 + eps)
    return p, m, v


def _grads(n, steps, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen).to(dtype) for _ in range(steps)]


@pytest.mark.parametrize("n", SIZES)
def test_matches_torch_adamw_in_float64(n):
    gen = torch.Generator().manual_seed(n)
    init = torch.randn(n, generator=gen)
    grads = _grads(n, 5, seed=n + 1)
    p = torch.nn.Parameter(init.clone())
    opt = DeepSpeedCPUAdam([p], lr=1e-2, weight_decay=0.1, betas=(0.9, 0.99), eps=1e-6)
    ref_p = torch.nn.Parameter(init.double().clone())
    ref = torch.optim.AdamW([ref_p], lr=1e-2, weight_decay=0.1, betas=(0.9, 0.99), eps=1e-6)
    for g in grads:
        p.grad = g.clone()
        ref_p.grad = g.double()
        opt.step()
        ref.step()
    displacement = (ref_p.detach() - init.double()).norm()
    err = (p.detach().double() - ref_p.detach()).norm() / displacement
    assert err < 1e-4, err  # fp32 arithmetic; a wrong formula gives > 1e-2
    st = opt.state[p]
    assert st["step"] == 5 and st["exp_avg"].dtype == torch.float32
    torch.testing.assert_close(
        st["exp_avg_sq"].double(), ref.state[ref_p]["exp_avg_sq"], rtol=1e-5, atol=1e-12
    )


@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_modes_match_float64_reference(adamw, bias_correction):
    n = 257
    init = torch.randn(n, generator=torch.Generator().manual_seed(3))
    grads = _grads(n, 4, seed=4)
    p = torch.nn.Parameter(init.clone())
    opt = DeepSpeedCPUAdam(
        [p], lr=3e-3, weight_decay=0.05, adamw_mode=adamw, bias_correction=bias_correction
    )
    for g in grads:
        p.grad = g
        opt.step()
    ref, m, v = _reference(init, grads, 3e-3, (0.9, 0.999), 1e-8, 0.05, adamw, bias_correction)
    err = (p.detach().double() - ref).norm() / (ref - init.double()).norm()
    assert err < 1e-4, err  # fp32 arithmetic; a wrong formula gives > 1e-2
    # Adam (L2) and AdamW really differ here, so a swapped flag cannot pass.
    other, _, _ = _reference(
        init, grads, 3e-3, (0.9, 0.999), 1e-8, 0.05, not adamw, bias_correction
    )
    assert (p.detach().double() - other).norm() / (ref - init.double()).norm() > 1e-3


@pytest.mark.parametrize("pdtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gdtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_16bit_params_fp32_states(pdtype, gdtype):
    n = 101
    init = torch.randn(n, generator=torch.Generator().manual_seed(5)).to(pdtype)
    p = torch.nn.Parameter(init.clone())
    opt = DeepSpeedCPUAdam([p], lr=1e-2)
    g = torch.randn(n, generator=torch.Generator().manual_seed(6)).to(gdtype)
    if hasattr(p, "grad_dtype"):  # torch >= 2.10 checks .grad's dtype unless told otherwise
        p.grad_dtype = None
    p.grad = g
    opt.step()
    assert p.dtype == pdtype and opt.state[p]["exp_avg"].dtype == torch.float32
    # One step from the 16-bit weight, in fp32, rounded once (DeepSpeed keeps no master copy).
    ref, m, _ = _reference(init.float(), [g.float()], 1e-2, (0.9, 0.999), 1e-8, 0.0, True, True)
    ulp = 2.0**-8 if pdtype == torch.bfloat16 else 2.0**-11  # half an ulp, relative
    assert ((p.detach().double() - ref).abs() <= ref.abs() * ulp + 1e-30).all()
    torch.testing.assert_close(opt.state[p]["exp_avg"].double(), m, rtol=1e-6, atol=1e-7)


def test_fp32_optimizer_states_false_keeps_param_dtype():
    p = torch.nn.Parameter(torch.randn(9).bfloat16())
    opt = DeepSpeedCPUAdam([p], fp32_optimizer_states=False)
    p.grad = torch.randn(9).bfloat16()
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == torch.bfloat16
    assert opt.state[p]["exp_avg_sq"].abs().sum() > 0


def test_state_dict_round_trip_continues_identically():
    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.Linear(7, 3)).bfloat16()
        return model, DeepSpeedCPUAdam(
            [{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 1e-2}],
            lr=1e-3,
            weight_decay=0.01,
        )

    def train(model, opt, steps, seed):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            loss = model(torch.randn(4, 13, generator=gen).bfloat16()).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()

    a, opt_a = make()
    train(a, opt_a, 3, seed=1)
    saved_model = copy.deepcopy(a.state_dict())
    saved_opt = copy.deepcopy(opt_a.state_dict())
    train(a, opt_a, 2, seed=2)

    b, opt_b = make()
    b.load_state_dict(saved_model)
    opt_b.load_state_dict(saved_opt)
    p = next(b.parameters())
    assert opt_b.state[p]["exp_avg"].dtype == torch.float32  # not cast to the bf16 param's
    assert opt_b.state[p]["step"] == 3
    train(b, opt_b, 2, seed=2)
    for x, y in zip(a.parameters(), b.parameters()):
        assert torch.equal(x, y)
    assert opt_b.param_groups[1]["lr"] == 1e-2


def test_bad_arguments_are_named():
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(RuntimeError, match="AMSGrad"):
        DeepSpeedCPUAdam([p], amsgrad=True)
    with pytest.raises(ValueError, match="betas\\[1\\]"):
        DeepSpeedCPUAdam([p], betas=(0.9, 1.5))
    with pytest.raises(ValueError, match="lr"):
        DeepSpeedCPUAdam([p], lr=-1)
    with pytest.raises(ValueError, match="float64"):
        DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))])


def test_skips_params_without_grad():
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = DeepSpeedCPUAdam([a, b])
    a.grad = torch.ones(3)
    opt.step()
    assert torch.equal(b.detach(), torch.ones(3)) and b not in opt.state
    assert not torch.equal(a.detach(), torch.ones(3))


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fused_adam_is_torch_adam(adam_w_mode):
    init = torch.randn(31)
    grads = _grads(31, 3, seed=9)
    p = torch.nn.Parameter(init.clone())
    opt = FusedAdam([p], lr=1e-2, weight_decay=0.1, adam_w_mode=adam_w_mode)
    q = torch.nn.Parameter(init.clone())
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    ref = cls([q], lr=1e-2, weight_decay=0.1)
    for g in grads:
        p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)
    opt.zero_grad()
    assert p.grad is None
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedAdam([p], amsgrad=True)
