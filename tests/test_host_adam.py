"""Tests of the host Adam update kernel (zero_offload.kernels.host_adam).

Every kernel result is checked against a float64 implementation of the same math computed
from the same inputs. Data are fresh random numbers on every run: the seed is printed, so a
failure can be replayed with ZO_TEST_SEED=<seed>.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
import warnings

import pytest
import torch

from zero_offload.kernels import default_threads, host_adam_step, kernel_info, reference_adam_step
from zero_offload.kernels import host_adam as ha

C = ha._C
needs_cpp = pytest.mark.skipif(C is None, reason=f"compiled kernel unavailable: {ha._IMPORT_ERROR}")

GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
OUT_DTYPES = [None, torch.bfloat16, torch.float16]
# (adamw, weight_decay)
MODES = [(False, 0.0), (False, 0.05), (True, 0.0), (True, 0.05)]
SIZES = [1, 7, 17, 1000003]
RTOL = 1e-6  # fp32 math vs float64, relative, after a few steps


@pytest.fixture
def gen():
    seed = int(os.environ.get("ZO_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"ZO_TEST_SEED={seed}")  # shown by pytest on failure
    g = torch.Generator().manual_seed(seed)
    return g


@pytest.fixture(autouse=True)
def _auto_kernel(monkeypatch):
    # Tests choose the path explicitly; an ambient ZERO_OFFLOAD_KERNEL must not leak in.
    monkeypatch.delenv("ZERO_OFFLOAD_KERNEL", raising=False)


@pytest.fixture
def isa_restore():
    if C is None:
        yield
        return
    saved = C.get_isa()
    yield
    C.set_isa(saved)


def make_inputs(n, grad_dtype, out_dtype, gen):
    master = torch.randn(n, generator=gen)
    exp_avg = torch.randn(n, generator=gen) * 1e-2
    exp_avg_sq = torch.rand(n, generator=gen) * 1e-4
    grad = (torch.randn(n, generator=gen) * 3.0).to(grad_dtype)
    out = None if out_dtype is None else torch.full((n,), float("nan"), dtype=out_dtype)
    return master, exp_avg, exp_avg_sq, grad, out


def hyper(step, adamw, weight_decay, bias_correction=True, grad_scale=0.37):
    return dict(
        step=step,
        lr=1e-3,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=weight_decay,
        adamw=adamw,
        bias_correction=bias_correction,
        grad_scale=grad_scale,
    )


class Adam64:
    """Independent float64 implementation of the documented semantics.

    Alongside p, m, v it carries the magnitudes mag_p, mag_m of the terms that were summed into
    p and m (the same recurrences on absolute values), so that errors can be judged relative to
    the conditioning of the computation: where a sum cancels (m or p crossing zero) the fp32
    result cannot be relatively accurate to its own tiny value, only to the summed terms.
    """

    def __init__(self, master, exp_avg, exp_avg_sq):
        self.p, self.m, self.v = master.double(), exp_avg.double(), exp_avg_sq.double()
        self.mag_p, self.mag_m = self.p.abs(), self.m.abs()

    def step(
        self, grad, *, step, lr, beta1, beta2, eps, weight_decay, adamw, bias_correction, grad_scale
    ):
        p, m, v = self.p, self.m, self.v
        g = grad.double() * grad_scale
        mag_g = g.abs()
        if weight_decay > 0 and not adamw:
            g = g + weight_decay * p
            mag_g = mag_g + weight_decay * self.mag_p
        m = beta1 * m + (1 - beta1) * g
        self.mag_m = beta1 * self.mag_m + (1 - beta1) * mag_g
        v = beta2 * v + (1 - beta2) * g * g
        bc1 = 1 - beta1**step if bias_correction else 1.0
        bc2 = 1 - beta2**step if bias_correction else 1.0
        denom = v.sqrt() / math.sqrt(bc2) + eps
        mag_p = self.mag_p
        if weight_decay > 0 and adamw:
            p = p - lr * weight_decay * p
            mag_p = mag_p * (1 + lr * weight_decay)
        p = p - (lr / bc1) * m / denom
        self.mag_p = mag_p + (lr / bc1) * self.mag_m / denom
        self.p, self.m, self.v = p, m, v


def assert_close_f64(name, got, ref, mag, seed, rtol=RTOL):
    """|got - ref| <= rtol * mag, mag >= |ref| being the magnitude of the summed terms."""
    err = (got.double() - ref).abs()
    bad = err > rtol * mag
    if bad.any():
        i = int(bad.nonzero()[0])
        raise AssertionError(
            f"{name}: {int(bad.sum())} elements off (seed {seed}); first at {i}: got "
            f"{got[i].item()!r}, float64 {ref[i].item()!r}, max err/magnitude "
            f"{(err / mag.clamp_min(1e-300)).max().item():.3g}"
        )


def check_state(ref: Adam64, master, exp_avg, exp_avg_sq, seed, rtol=RTOL):
    assert_close_f64("master", master, ref.p, ref.mag_p, seed, rtol)
    assert_close_f64("exp_avg", exp_avg, ref.m, ref.mag_m, seed, rtol)
    # v collects ~5 roundings per step (g*scale enters squared); observed max ~5e-7 after 3 steps.
    assert_close_f64("exp_avg_sq", exp_avg_sq, ref.v, ref.v.abs(), seed, 2 * rtol)


def bits(t):
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def assert_bitwise(a, b, what):
    if not torch.equal(bits(a), bits(b)):
        diff = (bits(a) != bits(b)).nonzero()
        raise AssertionError(f"{what}: {diff.numel()} elements differ, first at {int(diff[0])}")


def run_and_check(step_fn, n, grad_dtype, out_dtype, adamw, wd, bias_correction, gen, steps=3):
    master, exp_avg, exp_avg_sq, grad, out = make_inputs(n, grad_dtype, out_dtype, gen)
    ref = Adam64(master, exp_avg, exp_avg_sq)
    for step in range(1, steps + 1):
        if step > 1:  # a new gradient every step
            grad = (torch.randn(n, generator=gen) * 3.0).to(grad_dtype)
            if out is not None:
                out.fill_(float("nan"))  # poison: an unwritten element fails the check below
        h = hyper(step, adamw, wd, bias_correction)
        step_fn(master, exp_avg, exp_avg_sq, grad, out, **h)
        ref.step(grad, **h)
        if out is not None:
            assert_bitwise(out, master.to(out_dtype), f"param_out vs master rounded, step {step}")
    check_state(ref, master, exp_avg, exp_avg_sq, gen.initial_seed())


# ------------------------------------------------------------------------------------------------
# The kernel against float64
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("adamw,wd", MODES)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
def test_kernel_matches_float64_small(grad_dtype, out_dtype, adamw, wd, bias_correction, gen):
    for n in SIZES[:-1]:
        run_and_check(host_adam_step, n, grad_dtype, out_dtype, adamw, wd, bias_correction, gen)


@pytest.mark.parametrize("adamw,wd", [(False, 0.05), (True, 0.05)])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
def test_kernel_matches_float64_large(grad_dtype, out_dtype, adamw, wd, gen):
    run_and_check(host_adam_step, SIZES[-1], grad_dtype, out_dtype, adamw, wd, True, gen)


@pytest.mark.parametrize("adamw,wd", MODES)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
def test_reference_matches_float64(grad_dtype, adamw, wd, gen):
    for n in (1, 17, 1000003):
        run_and_check(reference_adam_step, n, grad_dtype, torch.bfloat16, adamw, wd, True, gen)


def test_forced_reference_path(monkeypatch, gen):
    monkeypatch.setenv("ZERO_OFFLOAD_KERNEL", "reference")
    info = kernel_info()
    assert info["kernel"] == "reference" and "ZERO_OFFLOAD_KERNEL" in info["reason"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a forced reference path does not warn
        run_and_check(host_adam_step, 1000, torch.bfloat16, torch.float16, True, 0.05, True, gen)


def test_many_steps_stay_close(gen):
    # 20 steps: errors accumulate slowly (still well within 1e-5 relative).
    master, exp_avg, exp_avg_sq, grad, out = make_inputs(4099, torch.bfloat16, torch.bfloat16, gen)
    ref = Adam64(master, exp_avg, exp_avg_sq)
    for step in range(1, 21):
        grad = (torch.randn(4099, generator=gen) * 3.0).to(torch.bfloat16)
        h = hyper(step, True, 0.1)
        host_adam_step(master, exp_avg, exp_avg_sq, grad, out, **h)
        ref.step(grad, **h)
    check_state(ref, master, exp_avg, exp_avg_sq, gen.initial_seed(), rtol=1e-5)
    assert_bitwise(out, master.to(torch.bfloat16), "param_out")


# ------------------------------------------------------------------------------------------------
# Bitwise invariances of the compiled kernel
# ------------------------------------------------------------------------------------------------


@needs_cpp
@pytest.mark.parametrize(
    "grad_dtype,out_dtype",
    [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), (torch.float32, None)],
    ids=str,
)
def test_threads_bitwise_equal(grad_dtype, out_dtype, gen):
    n = 5 * 65536 + 12345  # several work blocks plus a tail
    base = make_inputs(n, grad_dtype, out_dtype, gen)
    results = []
    for threads in (1, 2, 3, 4, 7):
        t = [None if x is None else x.clone() for x in base]
        for step in (1, 2):
            host_adam_step(*t, **hyper(step, True, 0.05), threads=threads)
        results.append(t)
    for threads, t in zip((2, 3, 4, 7), results[1:]):
        for name, a, b in zip(
            ("master", "exp_avg", "exp_avg_sq", "grad", "param_out"), results[0], t
        ):
            if a is not None:
                assert_bitwise(a, b, f"{name}: threads={threads} vs 1")


@needs_cpp
@pytest.mark.parametrize("adamw,wd", MODES)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
def test_isa_variants_bitwise_equal_to_scalar(grad_dtype, out_dtype, adamw, wd, gen, isa_restore):
    isas = C.supported_isas()
    assert isas[0] == "scalar"
    if len(isas) == 1:
        pytest.skip("only the scalar variant is supported on this CPU")
    n = 2 * 65536 + 1000 + 37  # block boundary, SIMD body and a tail that starts mid-vector
    base = make_inputs(n, grad_dtype, out_dtype, gen)
    results = {}
    for isa in isas:
        C.set_isa(isa)
        t = [None if x is None else x.clone() for x in base]
        for step in (1, 2):
            host_adam_step(*t, **hyper(step, adamw, wd, bias_correction=step == 1), threads=2)
        results[isa] = t
    for isa in isas[1:]:
        for name, a, b in zip(
            ("master", "exp_avg", "exp_avg_sq", "grad", "param_out"),
            results["scalar"],
            results[isa],
        ):
            if a is not None:
                assert_bitwise(a, b, f"{name}: {isa} vs scalar")


@needs_cpp
def test_isa_variants_special_values(gen, isa_restore):
    # Subnormal, huge, zero, inf and NaN inputs: every variant gives the same bits (NaN: any NaN).
    specials = torch.tensor(
        [
            0.0,
            -0.0,
            1e-45,
            -1e-45,
            1e-40,
            1.2e-38,
            3e38,
            -3e38,
            65504.0,
            65520.0,
            1e-7,
            6e-8,
            3e-8,
            float("inf"),
            float("-inf"),
            float("nan"),
        ]
    )
    n = 1001
    grad = torch.randn(n, generator=gen)
    grad[: specials.numel()] = specials
    grad[-specials.numel() :] = specials.flip(0)
    master = torch.randn(n, generator=gen)
    master[specials.numel() : 2 * specials.numel()] = specials
    results = {}
    for isa in C.supported_isas():
        C.set_isa(isa)
        outs = []
        for out_dtype in (torch.bfloat16, torch.float16):
            t = [
                master.clone(),
                torch.zeros(n),
                torch.zeros(n),
                grad.clone(),
                torch.empty(n, dtype=out_dtype),
            ]
            host_adam_step(*t, **hyper(1, True, 0.01))
            outs.append(t)
        results[isa] = outs
    for isa, outs in results.items():
        for ref, got in zip(results["scalar"], outs):
            for a, b in zip(ref, got):
                nan_a, nan_b = torch.isnan(a.float()), torch.isnan(b.float())
                assert torch.equal(nan_a, nan_b), f"{isa}: NaN positions differ"
                assert_bitwise(a[~nan_a], b[~nan_b], f"{isa} vs scalar on special values")


@needs_cpp
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_rounding_matches_torch(out_dtype, gen, isa_restore):
    # Random bit patterns (every exponent, subnormals, inf, NaN) plus rounding edge cases.
    raw = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), generator=gen, dtype=torch.int64)
    x = raw.to(torch.int32).view(torch.float32)
    edges = torch.tensor(
        [
            65504.0,
            65519.996,
            65520.0,
            2.0**-24,
            2.0**-25,
            2.0**-25 * 1.0000001,
            2.0**-14,
            2.0**-14 * (1 - 2.0**-12),
            1.0 + 2.0**-11,
            1.0 + 3 * 2.0**-11,
            1.0 + 2.0**-8,
            1.0 + 3 * 2.0**-8,
            3.3895314e38,
            3.4028235e38,
        ]
    )
    x = torch.cat([edges, -edges, x])
    ref = x.to(out_dtype)
    for isa in C.supported_isas():
        C.set_isa(isa)
        got = torch.empty_like(ref)
        C.round_f32(
            x.data_ptr(), got.data_ptr(), x.numel(), 1 if out_dtype == torch.bfloat16 else 2
        )
        nan = torch.isnan(x)
        assert torch.isnan(got[nan].float()).all(), f"{isa}: NaN not preserved"
        assert_bitwise(got[~nan], ref[~nan], f"{isa} rounding to {out_dtype}")


# ------------------------------------------------------------------------------------------------
# Buffers, threads, fallback
# ------------------------------------------------------------------------------------------------


def test_grad_may_alias_param_out(gen):
    master, exp_avg, exp_avg_sq, grad, out = make_inputs(70001, torch.bfloat16, torch.bfloat16, gen)
    ref = [t.clone() for t in (master, exp_avg, exp_avg_sq, grad, out)]
    host_adam_step(*ref, **hyper(1, True, 0.05))
    shared = grad.clone()
    host_adam_step(master, exp_avg, exp_avg_sq, shared, shared, **hyper(1, True, 0.05))
    assert_bitwise(master, ref[0], "master")
    assert_bitwise(shared, ref[4], "param_out written over grad")


def test_empty_tensors():
    e = torch.empty(0)
    host_adam_step(
        e, e.clone(), e.clone(), torch.empty(0, dtype=torch.bfloat16), None, **hyper(1, True, 0.1)
    )


def test_master_may_be_a_parameter(gen):
    master, exp_avg, exp_avg_sq, grad, out = make_inputs(100, torch.float32, None, gen)
    p = torch.nn.Parameter(master.clone())
    host_adam_step(p, exp_avg.clone(), exp_avg_sq.clone(), grad, None, **hyper(1, True, 0.1))
    reference_adam_step(master, exp_avg, exp_avg_sq, grad, None, **hyper(1, True, 0.1))
    torch.testing.assert_close(p.detach(), master, rtol=1e-6, atol=1e-9)


@needs_cpp
def test_concurrent_callers(gen):
    # The GIL is released: several Python threads may call at once (calls are serialised on the
    # pool); each must get exactly the single-threaded result.
    inputs = [make_inputs(300_000 + i, torch.bfloat16, torch.bfloat16, gen) for i in range(4)]
    expected = []
    for t in inputs:
        e = [x.clone() for x in t]
        host_adam_step(*e, **hyper(1, False, 0.05), threads=1)
        expected.append(e)
    errors = []

    def work(t):
        try:
            host_adam_step(*t, **hyper(1, False, 0.05), threads=2)
        except Exception as exc:  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in inputs]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    for t, e in zip(inputs, expected):
        for a, b in zip(t, e):
            assert_bitwise(a, b, "concurrent call")


@needs_cpp
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_usable_after_fork(gen):
    t = make_inputs(300_000, torch.bfloat16, torch.bfloat16, gen)
    host_adam_step(*[x.clone() for x in t], **hyper(1, True, 0.0), threads=2)  # pool exists now
    expected = [x.clone() for x in t]
    host_adam_step(*expected, **hyper(1, True, 0.0), threads=1)
    pid = os.fork()
    if pid == 0:  # child: the parent's pool threads do not exist here
        code = 1
        try:
            host_adam_step(*t, **hyper(1, True, 0.0), threads=2)
            # (no parallel torch ops here: GNU OpenMP's thread pool does not survive fork)
            same = all(
                bits(a).numpy().tobytes() == bits(b).numpy().tobytes() for a, b in zip(t, expected)
            )
            code = 0 if same else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 120
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung in host_adam_step")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0


def test_fallback_warns_once(monkeypatch, gen):
    monkeypatch.setattr(ha, "_C", None)
    monkeypatch.setattr(ha, "_IMPORT_ERROR", "ImportError: simulated")
    monkeypatch.setattr(ha, "_fallback_warned", False)
    info = kernel_info()
    assert info["kernel"] == "reference" and "simulated" in info["reason"]
    with pytest.warns(RuntimeWarning, match="compiled kernel is unavailable.*simulated"):
        run_and_check(
            host_adam_step, 33, torch.bfloat16, torch.bfloat16, True, 0.05, True, gen, steps=1
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_and_check(
            host_adam_step, 33, torch.bfloat16, torch.bfloat16, True, 0.05, True, gen, steps=1
        )
    monkeypatch.setenv("ZERO_OFFLOAD_KERNEL", "cpp")
    with pytest.raises(RuntimeError, match="ZERO_OFFLOAD_KERNEL=cpp"):
        kernel_info()


def test_kernel_info_and_default_threads(monkeypatch):
    info = kernel_info()
    assert set(info) >= {"kernel", "isa", "simd_width", "threads", "reason"}
    if C is not None:
        assert info["kernel"] == "cpp" and info["isa"] in ("avx512", "avx2", "scalar")
        assert info["simd_width"] == {"avx512": 16, "avx2": 8, "scalar": 1}[info["isa"]]
        assert info["reason"] is None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert default_threads() == cores
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert default_threads() == max(1, cores // 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "100000")
    assert default_threads() == 1


# ------------------------------------------------------------------------------------------------
# Validation: errors name the argument
# ------------------------------------------------------------------------------------------------


def _good(n=10):
    return dict(
        master=torch.zeros(n),
        exp_avg=torch.zeros(n),
        exp_avg_sq=torch.zeros(n),
        grad=torch.zeros(n, dtype=torch.bfloat16),
        param_out=torch.zeros(n, dtype=torch.bfloat16),
    )


@pytest.mark.parametrize("fn", [host_adam_step, reference_adam_step])
@pytest.mark.parametrize(
    "change,match",
    [
        (dict(master=torch.zeros(10, dtype=torch.float64)), "master must have dtype float32"),
        (dict(master=[0.0] * 10), "master must be a torch.Tensor"),
        (dict(exp_avg=torch.zeros(11)), "exp_avg has 11 elements"),
        (dict(exp_avg_sq=torch.zeros(10, dtype=torch.bfloat16)), "exp_avg_sq must have dtype"),
        (dict(grad=torch.zeros(20)[::2]), "grad must be contiguous"),
        (
            dict(grad=torch.zeros(10, dtype=torch.int32)),
            "grad must have dtype float32, bfloat16, float16",
        ),
        (dict(param_out=torch.zeros(10)), "param_out must have dtype bfloat16, float16"),
        (dict(param_out=torch.zeros(9, dtype=torch.float16)), "param_out has 9 elements"),
        (dict(step=0), "step must be an int >= 1"),
        (dict(step=1.0), "step must be an int >= 1"),
        (dict(threads=0), "threads must be None or an int >= 1"),
        (dict(lr=-1.0), "lr must be >= 0"),
        (dict(beta1=1.0), "beta1 must be < 1"),
        (dict(beta2=-0.1), "beta2 must be >= 0"),
        (dict(eps=float("nan")), "eps must be finite"),
        (dict(weight_decay=-0.1), "weight_decay must be >= 0"),
        (dict(grad_scale=float("inf")), "grad_scale must be finite"),
    ],
)
def test_validation_names_the_argument(fn, change, match):
    kw = dict(
        _good(),
        step=1,
        lr=1e-3,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.0,
        adamw=True,
        threads=None,
    )
    kw.update(change)
    args = [kw.pop(k) for k in ("master", "exp_avg", "exp_avg_sq", "grad", "param_out")]
    with pytest.raises(ValueError, match=match):
        fn(*args, **kw)


def test_validation_rejects_overlap():
    g = _good()
    buf = torch.zeros(20)
    with pytest.raises(ValueError, match="master and exp_avg overlap"):
        host_adam_step(
            buf[:10], buf[5:15], g["exp_avg_sq"], g["grad"], g["param_out"], **hyper(1, True, 0.0)
        )
    big = torch.zeros(11, dtype=torch.bfloat16)  # grad and param_out shifted by one element
    with pytest.raises(ValueError, match="grad and param_out overlap"):
        host_adam_step(
            g["master"], g["exp_avg"], g["exp_avg_sq"], big[:10], big[1:], **hyper(1, True, 0.0)
        )
    grad32 = torch.zeros(10)  # same start address, but an fp32 grad under a 16-bit param_out
    with pytest.raises(ValueError, match="grad and param_out overlap"):
        host_adam_step(
            g["master"],
            g["exp_avg"],
            g["exp_avg_sq"],
            grad32,
            grad32.view(torch.float16)[:10],
            **hyper(1, True, 0.0),
        )


@needs_cpp
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_streaming_stores_bitwise_equal(out_dtype, gen, isa_restore):
    # param_out may be written with non-temporal stores when it is aligned; results must not
    # change, and an unaligned param_out (a view at an odd offset) must still be fully written.
    n = 3 * 65536 + 77
    base = make_inputs(n, torch.bfloat16, out_dtype, gen)
    saved = C.set_stream_out(False)
    try:
        for isa in C.supported_isas():
            C.set_isa(isa)
            results = []
            for stream, offset in ((False, 0), (True, 0), (True, 1)):
                C.set_stream_out(stream)
                t = [x.clone() for x in base[:4]]
                storage = torch.full((n + 1,), float("nan"), dtype=out_dtype)
                out = storage[offset : offset + n]
                host_adam_step(*t, out, **hyper(1, True, 0.05), threads=2)
                results.append(t + [out])
            for r in results[1:]:
                for a, b in zip(results[0], r):
                    assert_bitwise(a, b, f"{isa}: streaming stores change the result")
    finally:
        C.set_stream_out(saved)


def test_accepts_numpy_and_tensor_scalars(gen):
    np = pytest.importorskip("numpy")
    master, exp_avg, exp_avg_sq, grad, out = make_inputs(1000, torch.bfloat16, torch.bfloat16, gen)
    expected = [t.clone() for t in (master, exp_avg, exp_avg_sq, grad, out)]
    host_adam_step(*expected, **hyper(3, True, 0.05))
    h = hyper(3, True, 0.05)
    h.update(
        step=np.int64(3),
        lr=torch.tensor(1e-3, dtype=torch.float64),
        beta1=np.float64(0.9),
        threads=np.int32(2),
    )
    host_adam_step(master, exp_avg, exp_avg_sq, grad, out, **h)
    for a, b in zip((master, exp_avg, exp_avg_sq, out), expected[:3] + expected[4:]):
        assert_bitwise(a, b, "numpy/tensor scalars")
