"""Tests of the compact-state host Adam update (zero_offload.kernels.adam_states): bf16 master,
bf16 moments, blockwise 8-bit moments, stochastic rounding.

The kernel's arithmetic between the state loads and stores is the fp32-state kernel's, so the
strongest checks are bitwise: decode the states with the reference, run the fp32-state kernel,
store with the reference's rounding/encoding, and compare with the compact kernel. Every ISA
variant must equal the scalar one bitwise. The PyTorch reference (the fallback) is checked to
agree to fp32 rounding. Seeds are printed; replay with ZO_TEST_SEED=<seed>.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from zero_offload.kernels import (
    QuantizedMoment,
    StateOptions,
    adam_step_states,
    dequantize_moment,
    host_adam_step,
    quantize_moment,
    reference_adam_step_states,
    zeros_moment,
)
from zero_offload.kernels import adam_states as st
from zero_offload.kernels import host_adam as ha
from zero_offload.kernels import quant_maps as qm

C = ha._C
needs_cpp = pytest.mark.skipif(C is None, reason=f"compiled kernel unavailable: {ha._IMPORT_ERROR}")

# (master dtype, state kind, stochastic rounding)
COMBOS = [
    (torch.float32, "bf16", False),
    (torch.float32, "q8", False),
    (torch.bfloat16, "f32", False),
    (torch.bfloat16, "f32", True),
    (torch.bfloat16, "bf16", False),
    (torch.bfloat16, "bf16", True),
    (torch.bfloat16, "q8", False),
    (torch.bfloat16, "q8", True),
]
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
MODES = [(False, 0.0), (False, 0.05), (True, 0.05)]  # (adamw, weight_decay)
# Two work blocks of the thread pool, a partial 8-bit block and a SIMD tail.
N = 65536 + 1000 + 37


@pytest.fixture
def gen():
    seed = int(os.environ.get("ZO_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"ZO_TEST_SEED={seed}")
    return torch.Generator().manual_seed(seed)


@pytest.fixture(autouse=True)
def _auto_kernel(monkeypatch):
    monkeypatch.delenv("ZERO_OFFLOAD_KERNEL", raising=False)


@pytest.fixture
def isa_restore():
    if C is None:
        yield
        return
    saved = C.get_isa()
    yield
    C.set_isa(saved)


def hyper(step, adamw=True, weight_decay=0.01, grad_scale=0.37):
    return dict(
        step=step,
        lr=1e-3,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=weight_decay,
        adamw=adamw,
        grad_scale=grad_scale,
    )


def make_state(n, master_dtype, kind, gen, block_size=256):
    master = torch.randn(n, generator=gen).to(master_dtype)
    m = torch.randn(n, generator=gen) * 1e-2
    v = torch.rand(n, generator=gen) ** 4 * 1e-4  # a wide spread, as real second moments have
    if kind == "q8":
        return master, quantize_moment(m, True, block_size), quantize_moment(v, False, block_size)
    dt = torch.float32 if kind == "f32" else torch.bfloat16
    return master, m.to(dt), v.to(dt)


def clone(x):
    if isinstance(x, QuantizedMoment):
        return QuantizedMoment(x.codes.clone(), x.scales.clone(), x.block_size, x.signed)
    return x.clone()


def flat(state):
    out = []
    for x in state:
        if isinstance(x, QuantizedMoment):
            out += [x.codes, x.scales]
        elif x is not None:
            out.append(x)
    return out


def assert_bitwise(a, b, what):
    for i, (x, y) in enumerate(zip(flat(a), flat(b), strict=True)):
        bx, by = x.view(torch.uint8), y.view(torch.uint8)
        if not torch.equal(bx, by):
            raise AssertionError(f"{what}: buffer {i} differs in {int((bx != by).sum())} bytes")


def fp32_kernel_then_store(state, grad, out, h, options):
    """Decode with the reference, run the fp32-state kernel, store with the reference's rounding
    and encoding: what the compact kernel must produce bitwise."""
    master, m, v = state
    p32 = master.to(torch.float32, copy=True)
    m32, v32 = st._load(m), st._load(v)
    host_adam_step(p32, m32, v32, grad, out, **h)
    if master.dtype == torch.bfloat16:
        seed = options.stochastic_round_seed
        if seed is None:
            master.copy_(p32)
        else:
            master.copy_(st.stochastic_round_bf16(p32, seed, h["step"], options.index_offset))
    else:
        master.copy_(p32)
    st._store(m, m32)
    st._store(v, v32)


# ------------------------------------------------------------------------------------------------
# The maps
# ------------------------------------------------------------------------------------------------


@needs_cpp
def test_maps_of_kernel_equal_python():
    tables = C.quant_maps()
    expected = [*qm.map_tables(True), *qm.map_tables(False)]
    for raw, want in zip(tables, expected, strict=True):
        got = torch.frombuffer(bytearray(raw), dtype=torch.float32)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_maps_shape():
    for signed in (True, False):
        value, mid = qm.map_tables(signed)
        assert value.numel() == 256 and bool((value[1:] >= value[:-1]).all())
        assert value[-1] == 1.0 and value[0] == (-value[-2] if signed else 0.0)
        assert bool((mid[:255] >= value[:255]).all()) and bool((mid[:255] <= value[1:]).all())
        assert 0.0 in value.tolist()


def test_quantize_roundtrip_is_nearest(gen):
    x = torch.randn(1000, generator=gen) * torch.rand(1000, generator=gen) ** 3
    q = quantize_moment(x, True, 64)
    back = dequantize_moment(q)
    value = qm.map_tables(True)[0]
    scale = q.scales.repeat_interleave(64)[:1000]
    # no other code of the map is closer to x / absmax than the chosen one
    dist = ((value[None, :] * scale[:, None]) - x[:, None]).abs()
    err = (back - x).abs()
    assert bool((err <= dist.min(dim=1).values + 1e-6 * scale).all())
    assert torch.equal(q.scales[:15], x[: 15 * 64].view(15, 64).abs().amax(1))
    assert q.scales[15] == x[15 * 64 :].abs().max()


def test_zeros_moment_decodes_to_zero():
    for signed in (True, False):
        q = zeros_moment(300, signed, 128)
        assert q.scales.numel() == 3
        assert torch.equal(dequantize_moment(q), torch.zeros(300))


# ------------------------------------------------------------------------------------------------
# The kernel: bitwise against the fp32-state kernel plus the documented stores, on every ISA
# ------------------------------------------------------------------------------------------------


@needs_cpp
@pytest.mark.parametrize("adamw,wd", MODES)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
@pytest.mark.parametrize("master_dtype,kind,sr", COMBOS)
def test_kernel_bitwise_on_every_isa(
    master_dtype, kind, sr, grad_dtype, adamw, wd, gen, isa_restore
):
    out_dtype = torch.bfloat16 if master_dtype == torch.float32 else None
    base = make_state(N, master_dtype, kind, gen)
    options = StateOptions(stochastic_round_seed=1234 if sr else None, index_offset=7)
    results = {}
    for step in (1, 2):
        grad = (torch.randn(N, generator=gen) * 3.0).to(grad_dtype)
        h = hyper(step, adamw, wd)
        expected = tuple(clone(x) for x in base)
        out_expected = None if out_dtype is None else torch.empty(N, dtype=out_dtype)
        fp32_kernel_then_store(expected, grad, out_expected, h, options)
        for isa in C.supported_isas():
            C.set_isa(isa)
            for threads in (1, 2):
                state = tuple(clone(x) for x in base)
                out = None if out_dtype is None else torch.full((N,), float("nan"), dtype=out_dtype)
                adam_step_states(*state, grad, out, threads=threads, options=options, **h)
                assert_bitwise(
                    state + (out,), expected + (out_expected,), f"{isa} x{threads} step {step}"
                )
                results[isa] = state
        base = results["scalar"]


@needs_cpp
@pytest.mark.parametrize("n", [1, 31, 257, 4099])
def test_small_sizes_bitwise(n, gen, isa_restore):
    for master_dtype, kind, sr in COMBOS:
        base = make_state(n, master_dtype, kind, gen, block_size=32)
        grad = torch.randn(n, generator=gen).to(torch.bfloat16)
        options = StateOptions(stochastic_round_seed=5 if sr else None)
        expected = tuple(clone(x) for x in base)
        fp32_kernel_then_store(expected, grad, None, hyper(3), options)
        for isa in C.supported_isas():
            C.set_isa(isa)
            state = tuple(clone(x) for x in base)
            adam_step_states(*state, grad, options=options, **hyper(3))
            assert_bitwise(state, expected, f"{isa} n={n} {master_dtype} {kind} sr={sr}")


def _codec_edge_grad() -> torch.Tensor:
    """Gradients that, with beta1 = 0 and grad_scale = 1, become the new exp_avg exactly, and
    with a 1.0 in each 256-block (absmax 1) are the encoder's y: every midpoint of the first
    moment's map, its fp32 neighbours, both signs; then a block of subnormals, whose
    1 / absmax overflows, so y is +-inf and NaN (0 * inf)."""
    mid = qm.map_tables(True)[1][:255]
    u = mid.view(torch.int32)
    near = torch.cat([mid, (u - 1).view(torch.float32), (u + 1).view(torch.float32)])
    near = torch.cat([near, -near])
    near = near[near.abs() <= 1]
    blocks = near.split(255)
    parts = [torch.cat([torch.ones(1), b]) for b in blocks]
    tiny = torch.full((256,), 1e-40)
    tiny[::3] = -1e-40
    tiny[::7] = 0.0
    return torch.cat(parts + [tiny, torch.tensor([1.0, -0.25, 0.5])])


@needs_cpp
def test_8bit_encode_at_midpoints_and_infinities_every_isa(isa_restore):
    """The encode of a tie (y exactly a midpoint: the larger code), of its neighbours, of +inf
    (255, as the search) and -inf and NaN (0) on every dispatch path equals the reference."""
    grad = _codec_edge_grad()
    n = grad.numel()
    h = dict(hyper(1, adamw=True, weight_decay=0.0, grad_scale=1.0), beta1=0.0, beta2=0.0)
    base = (torch.zeros(n), zeros_moment(n, True), zeros_moment(n, False))
    expected = tuple(clone(x) for x in base)
    fp32_kernel_then_store(expected, grad, None, h, StateOptions())
    codes = expected[1].codes
    assert {0, 255} <= set(codes[-259:-3].tolist())  # the infinities' codes are there
    for isa in C.supported_isas():
        C.set_isa(isa)
        state = tuple(clone(x) for x in base)
        adam_step_states(*state, grad, None, **h)
        assert_bitwise(state, expected, f"{isa} codec edges")


@needs_cpp
def test_bf16_states_are_deepspeeds_rounding(gen):
    """DeepSpeed's CPU Adam with bf16 params and bf16 moments: load exactly, the fp32 update in
    its order, store rounded to nearest even. That is the fp32 kernel on the upcast states."""
    master, m, v = make_state(10007, torch.bfloat16, "bf16", gen)
    grad = torch.randn(10007, generator=gen).to(torch.bfloat16)
    p32, m32, v32 = master.float(), m.float(), v.float()
    h = hyper(5, adamw=True, weight_decay=0.1, grad_scale=1.0)
    host_adam_step(p32, m32, v32, grad, None, **h)
    adam_step_states(master, m, v, grad, **h)
    assert torch.equal(master, p32.bfloat16())
    assert torch.equal(m, m32.bfloat16()) and torch.equal(v, v32.bfloat16())


# ------------------------------------------------------------------------------------------------
# The PyTorch reference (the fallback)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("master_dtype,kind,sr", COMBOS)
def test_reference_matches_kernel_arithmetic(master_dtype, kind, sr, gen):
    """The reference does the same arithmetic in fp32; PyTorch does not fuse multiply-adds, so
    fp32 values may differ by an ulp, and a value next to a map midpoint may change code."""
    base = make_state(20011, master_dtype, kind, gen)
    options = StateOptions(stochastic_round_seed=99 if sr else None)
    expected = tuple(clone(x) for x in base)
    got = tuple(clone(x) for x in base)
    for step in (1, 2, 3):
        grad = torch.randn(20011, generator=gen).to(torch.bfloat16)
        fp32_kernel_then_store(expected, grad, None, hyper(step), options)
        reference_adam_step_states(*got, grad, options=options, **hyper(step))
    p_ulp = 2.0**-7 if master_dtype == torch.bfloat16 else 2.0**-20  # 1 bf16 ulp, 8 fp32 ulps
    diff = (got[0].float() - expected[0].float()).abs()
    # a moment that rounded the other way (a bf16 ulp, or an 8-bit code at a midpoint: a map step
    # of a few %) changes that element's update by as much: at most 3 steps x lr x that step
    slack = 3 * 1e-3 * {"q8": 0.05, "bf16": 2.0**-7, "f32": 0.0}[kind]
    assert float((diff - slack - p_ulp * expected[0].float().abs().clamp_min(1e-3)).max()) <= 0
    assert float((got[0] != expected[0]).float().mean()) < 0.05
    for a, b in zip(got[1:], expected[1:], strict=True):
        if isinstance(a, QuantizedMoment):
            assert int((a.codes.int() - b.codes.int()).abs().max()) <= 1
            assert float((a.codes != b.codes).float().mean()) < 0.01
            torch.testing.assert_close(a.scales, b.scales, rtol=1e-5, atol=0)
        else:
            torch.testing.assert_close(a.float(), b.float(), rtol=2**-7, atol=1e-12)


def test_forced_reference_path(monkeypatch, gen):
    base = make_state(1000, torch.bfloat16, "q8", gen)
    grad = torch.randn(1000, generator=gen)
    a = tuple(clone(x) for x in base)
    b = tuple(clone(x) for x in base)
    reference_adam_step_states(*a, grad, **hyper(1))
    monkeypatch.setenv("ZERO_OFFLOAD_KERNEL", "reference")
    adam_step_states(*b, grad, **hyper(1))
    assert_bitwise(a, b, "forced reference")


def test_fallback_without_compiled_module_warns(monkeypatch, gen):
    monkeypatch.setattr(ha, "_C", None)
    monkeypatch.setattr(ha, "_IMPORT_ERROR", "not built (test)")
    monkeypatch.setattr(ha, "_fallback_warned", False)
    base = make_state(500, torch.bfloat16, "bf16", gen)
    grad = torch.randn(500, generator=gen)
    a = tuple(clone(x) for x in base)
    with pytest.warns(RuntimeWarning, match="PyTorch reference"):
        adam_step_states(*base, grad, **hyper(1))
    reference_adam_step_states(*a, grad, **hyper(1))
    assert_bitwise(base, a, "fallback")


# ------------------------------------------------------------------------------------------------
# Stochastic rounding
# ------------------------------------------------------------------------------------------------


@needs_cpp
@pytest.mark.parametrize("offset", [0, 12345, 2**32 - 20, 2**40 + 3])
def test_sr_round_equals_python_on_every_isa(offset, gen, isa_restore):
    x = torch.randn(1000, generator=gen) * 10.0 ** torch.randint(-30, 30, (1000,), generator=gen)
    x[:6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 3.4e38])
    want = st.stochastic_round_bf16(x, seed=2**40 + 17, step=9, index_offset=offset)
    for isa in C.supported_isas():
        C.set_isa(isa)
        got = torch.empty(1000, dtype=torch.bfloat16)
        C.sr_round_bf16(x.data_ptr(), got.data_ptr(), 1000, 2**40 + 17, 9, offset)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), isa


def test_sr_is_deterministic_and_rounds_to_a_neighbour(gen):
    x = torch.randn(4096, generator=gen)
    a = st.stochastic_round_bf16(x, 1, 1)
    assert torch.equal(a, st.stochastic_round_bf16(x, 1, 1))
    assert not torch.equal(a, st.stochastic_round_bf16(x, 2, 1))  # another seed
    assert not torch.equal(a, st.stochastic_round_bf16(x, 1, 2))  # another step
    down = x.view(torch.int32).bitwise_and(-65536).view(torch.float32)  # toward zero
    up = st.stochastic_round_bf16(x.view(torch.int32).bitwise_or(0xFFFF).view(torch.float32), 0, 0)
    assert bool(((a.float() == down) | (a.float() == up.float())).all())


def test_sr_is_unbiased():
    # 1 + 0.3 ulp: rounds up with probability 0.3
    ulp = 2.0**-7
    x = torch.full((200_000,), 1.0 + 0.3 * ulp)
    r = st.stochastic_round_bf16(x, 42, 1).float()
    frac_up = float((r > 1.0).float().mean())
    assert abs(frac_up - 0.3) < 0.01


@needs_cpp
def test_sr_keeps_small_updates_that_nearest_drops():
    """An update below half a bf16 ulp of the weight: nearest rounding never moves the weight,
    stochastic rounding moves it by the right amount on average."""
    n = 4096
    h = dict(lr=1e-4, beta1=0.0, beta2=0.0, eps=0.0, weight_decay=0.0, adamw=True)
    h["bias_correction"] = False
    results = {}
    for sr in (None, 7):
        master = torch.ones(n, dtype=torch.bfloat16)
        m, v = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
        grad = torch.ones(n)  # the update is -lr each step (m / sqrt(v) = 1)
        for step in range(1, 101):
            adam_step_states(master, m, v, grad, step=step, options=StateOptions(sr), **h)
        results[sr] = master.float().mean().item()
    assert results[None] == 1.0  # 100 updates of 1e-4 < ulp(1)/2 = 3.9e-3: all lost
    assert abs(results[7] - (1.0 - 100 * 1e-4)) < 1e-3


@needs_cpp
def test_sr_index_offset_makes_shards_equal_the_whole(gen):
    n = 70_000
    master, m, v = make_state(n, torch.bfloat16, "bf16", gen)
    grad = torch.randn(n, generator=gen)
    whole = tuple(clone(x) for x in (master, m, v))
    adam_step_states(*whole, grad, options=StateOptions(11), **hyper(4))
    cut = 33_333
    for lo, hi in ((0, cut), (cut, n)):
        adam_step_states(
            master[lo:hi],
            m[lo:hi],
            v[lo:hi],
            grad[lo:hi],
            options=StateOptions(11, index_offset=lo),
            **hyper(4),
        )
    assert_bitwise((master, m, v), whole, "shards vs whole")


# ------------------------------------------------------------------------------------------------
# 8-bit Adam trains
# ------------------------------------------------------------------------------------------------


def _train_regression(kind, steps=400):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 64, generator=g)
    w_true = torch.randn(64, 16, generator=g)
    y = x @ w_true + 0.1 * torch.randn(512, 16, generator=g)
    w = torch.zeros(64 * 16)
    if kind == "q8":
        m, v = zeros_moment(w.numel(), True), zeros_moment(w.numel(), False)
    else:
        m, v = torch.zeros_like(w), torch.zeros_like(w)
    for step in range(1, steps + 1):
        wt = w.view(64, 16).requires_grad_(True)
        loss = ((x @ wt - y) ** 2).mean()
        (grad,) = torch.autograd.grad(loss, wt)
        w = w.detach()
        adam_step_states(
            w,
            m,
            v,
            grad.reshape(-1).contiguous(),
            step=step,
            lr=0.02,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.0,
            adamw=True,
        )
    return float(((x @ w.view(64, 16) - y) ** 2).mean())


def test_8bit_adam_converges_like_fp32_adam():
    fp32 = _train_regression("f32")
    q8 = _train_regression("q8")
    assert fp32 < 0.05  # it trained (the noise floor is 0.01)
    assert q8 <= fp32 * 1.05, (q8, fp32)


# ------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------


def _args(n=64):
    return [
        torch.zeros(n, dtype=torch.bfloat16),
        zeros_moment(n, True, 32),
        zeros_moment(n, False, 32),
        torch.zeros(n),
    ]


@pytest.mark.parametrize(
    "change,match",
    [
        (
            lambda a: a.__setitem__(0, torch.zeros(64, dtype=torch.float16)),
            "master must have dtype",
        ),
        (
            lambda a: a.__setitem__(1, torch.zeros(64)),
            "exp_avg and exp_avg_sq must be the same state kind",
        ),
        (
            lambda a: a.__setitem__(1, zeros_moment(64, False, 32)),
            "exp_avg must be a QuantizedMoment with signed=True",
        ),
        (
            lambda a: a.__setitem__(2, zeros_moment(64, True, 32)),
            "exp_avg_sq must be a QuantizedMoment with signed=False",
        ),
        (lambda a: a.__setitem__(2, zeros_moment(64, False, 64)), "block_size .* must be equal"),
        (
            lambda a: a.__setitem__(
                1, QuantizedMoment(torch.zeros(64, dtype=torch.uint8), torch.zeros(2), 48)
            ),
            "exp_avg.block_size must be a power of two",
        ),
        (
            lambda a: a.__setitem__(
                1, QuantizedMoment(torch.zeros(64, dtype=torch.uint8), torch.zeros(3), 32)
            ),
            "exp_avg.scales has 3 elements",
        ),
        (
            lambda a: a.__setitem__(
                1, QuantizedMoment(torch.zeros(64, dtype=torch.int8), torch.zeros(2), 32)
            ),
            "exp_avg.codes must have dtype uint8",
        ),
        (lambda a: a.__setitem__(2, "x"), "exp_avg_sq must be a torch.Tensor"),
        (lambda a: a.__setitem__(3, torch.zeros(63)), "grad has 63 elements"),
    ],
)
def test_validation_names_the_argument(change, match):
    a = _args()
    change(a)
    with pytest.raises(ValueError, match=match):
        adam_step_states(*a, **hyper(1))


def test_validation_of_outputs_and_options():
    a = _args()
    with pytest.raises(ValueError, match="param_out must be None with a bf16 master"):
        adam_step_states(*a, torch.zeros(64, dtype=torch.bfloat16), **hyper(1))
    f32 = [
        torch.zeros(64),
        torch.zeros(64, dtype=torch.bfloat16),
        torch.zeros(64, dtype=torch.bfloat16),
        torch.zeros(64),
    ]
    with pytest.raises(ValueError, match="stochastic_round_seed needs a bf16 master"):
        adam_step_states(*f32, options=StateOptions(1), **hyper(1))
    with pytest.raises(ValueError, match="stochastic_round_seed must be None or an int"):
        StateOptions(-1)
    with pytest.raises(ValueError, match="index_offset must be an int"):
        StateOptions(None, index_offset=1.5)
    with pytest.raises(ValueError, match="options must be a StateOptions"):
        adam_step_states(*a, options={"stochastic_round_seed": 1}, **hyper(1))
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        zeros_moment(64, True, 512)
    shared = torch.zeros(64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="master and exp_avg overlap"):
        adam_step_states(
            shared, shared, torch.zeros(64, dtype=torch.bfloat16), torch.zeros(64), **hyper(1)
        )


def test_fp32_states_use_the_fp32_kernel(gen):
    master, m, v = make_state(1000, torch.float32, "f32", gen)
    grad = torch.randn(1000, generator=gen)
    a = tuple(clone(x) for x in (master, m, v))
    host_adam_step(*a, grad, None, **hyper(2))
    adam_step_states(master, m, v, grad, **hyper(2))
    assert_bitwise((master, m, v), a, "fp32 states")


def test_empty_tensors():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        adam_step_states(
            torch.zeros(0, dtype=torch.bfloat16),
            zeros_moment(0, True),
            zeros_moment(0, False),
            torch.zeros(0),
            **hyper(1),
        )
