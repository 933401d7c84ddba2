"""The gradient norm's sum of squares (zero_offload.kernels.sumsq): the SIMD host kernel against
float64 and torch's fp32 norm, bitwise equal across ISAs and thread counts, NaN/Inf propagated,
the path chosen at run time, and the engine's norm taken through it."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading

import pytest
import torch

from zero_offload.kernels import host_adam as ha
from zero_offload.kernels import sumsq as sq
from zero_offload.kernels.sumsq import sum_of_squares

C = ha._C
needs_kernel = pytest.mark.skipif(not sq.kernel_available(), reason="compiled kernel unavailable")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Around the 64 lanes and the 65536-element blocks; several blocks for the threads.
SIZES = [0, 1, 7, 63, 64, 65, 1000, 65535, 65536, 65537, 3 * 65536 + 129]


@pytest.fixture(autouse=True)
def _auto_kernel(monkeypatch):
    monkeypatch.delenv("ZERO_OFFLOAD_KERNEL", raising=False)


@pytest.fixture
def isa_restore():
    saved = C.get_isa() if C is not None else None
    yield
    if saved is not None:
        C.set_isa(saved)


def _data(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + n)
    return (torch.randn(n, generator=g) * 3).to(dtype)


def _exact(t: torch.Tensor) -> float:
    return float(t.double().square().sum())


def _bits(x: torch.Tensor) -> int:
    return int(x.view(torch.int32))


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_equals_float64_and_torch(n, dtype):
    x = _data(n, dtype)
    got = sum_of_squares(x, backend="kernel")
    assert got.dtype == torch.float32 and got.shape == () and got.device == x.device
    exact = _exact(x)
    assert abs(float(got) - exact) <= 1e-5 * exact + 1e-30  # fp32 lanes of 1024 squares
    # torch's fp32 norm, squared (the path before the kernel): the same within fp32 rounding
    # of a long sum (its own error against float64 is ~1e-5 at a million elements).
    ref = float(sum_of_squares(x, backend="torch"))
    assert abs(float(got) - ref) <= 2e-4 * exact + 1e-30


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_bitwise_equal_across_isas_and_threads(dtype, isa_restore):
    x = _data(3 * 65536 + 127, dtype, seed=5)  # 63 elements in the SIMD variants' tail
    results = set()
    for isa in C.supported_isas():
        C.set_isa(isa)
        for threads in (1, 2, 3, 8):
            results.add(_bits(sum_of_squares(x, backend="kernel", threads=threads)))
    assert len(results) == 1


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("where", [0, 40, 64 * 5 + 3, 65536 + 70, 3 * 65536 + 128])
def test_nan_and_inf_propagate(dtype, where, isa_restore):
    """At the front, inside a SIMD group, in another block, in the tail; every ISA."""
    base = _data(3 * 65536 + 129, dtype, seed=7)
    cases = {"nan": [math.nan], "inf": [math.inf], "-inf": [-math.inf], "inf+nan": [math.inf]}
    for isa in C.supported_isas():
        C.set_isa(isa)
        for name, values in cases.items():
            x = base.clone()
            x[where] = values[0]
            if name == "inf+nan":
                x[(where + 65536) % x.numel()] = math.nan
            got = float(sum_of_squares(x, backend="kernel"))
            want = float(sum_of_squares(x, backend="torch"))
            assert (math.isnan(got) and math.isnan(want)) or got == want == math.inf, (isa, name)


@needs_kernel
def test_overflow_of_a_square_is_inf():
    x = torch.tensor([1e20, 1.0, 2.0], dtype=torch.float32)  # 1e40 > fp32 max
    assert float(sum_of_squares(x, backend="kernel")) == math.inf
    assert float(sum_of_squares(x, backend="torch")) == math.inf


@needs_kernel
def test_dispatch_chosen_at_run_time(monkeypatch):
    """A fresh process picks the best ISA the CPU has; ZERO_OFFLOAD_ISA forces another, and the
    sum is the same bits either way."""
    code = (
        "import torch; from zero_offload.kernels import sumsq as s; C = s._C; "
        "x = (torch.arange(100003, dtype=torch.float32) / 1000).to(torch.bfloat16); "
        "print(C.get_isa(), C.supported_isas()[-1], "
        "int(s.sum_of_squares(x, backend='kernel').view(torch.int32)))"
    )
    env = {k: v for k, v in os.environ.items() if k != "ZERO_OFFLOAD_ISA"}
    run = lambda e: subprocess.run(  # noqa: E731
        [sys.executable, "-c", code], env=e, capture_output=True, text=True, check=True
    ).stdout.split()
    active, best, bits = run(env)
    assert active == best
    forced = run({**env, "ZERO_OFFLOAD_ISA": "scalar"})
    assert forced[0] == "scalar" and forced[2] == bits


def test_path_choice(monkeypatch):
    x = _data(1000, torch.bfloat16)
    counting = _CountingKernel()
    kernel_calls = counting.sizes
    if sq.kernel_available():
        monkeypatch.setattr(sq, "_C", counting)
        sum_of_squares(x)
        assert kernel_calls == [1000]  # a contiguous host tensor: the kernel
    sum_of_squares(x[::2])  # not contiguous: torch
    monkeypatch.setenv("ZERO_OFFLOAD_KERNEL", "reference")
    sum_of_squares(x)
    assert len(kernel_calls) == (1 if sq.kernel_available() else 0)
    torch.testing.assert_close(
        sum_of_squares(x), sum_of_squares(x, backend="torch"), rtol=0, atol=0
    )


def test_bad_arguments_name_what_is_allowed():
    x = _data(10, torch.float32)
    with pytest.raises(ValueError, match="backend must be one of auto, kernel, torch"):
        sum_of_squares(x, backend="simd")
    if sq.kernel_available():
        with pytest.raises(ValueError, match="contiguous CPU tensor.*not contiguous"):
            sum_of_squares(x[::2], backend="kernel")
        with pytest.raises(ValueError, match="dtype float32, bfloat16 or float16"):
            sum_of_squares(x.double(), backend="kernel")
        with pytest.raises(ValueError, match="threads must be None or an int >= 1"):
            sum_of_squares(x, threads=0)


@needs_kernel
def test_busy_pool_runs_on_the_caller():
    """While another thread's host Adam update holds the thread pool, the sum runs on the
    calling thread (same bits) instead of waiting for it."""
    n = 4 << 20
    state = [torch.randn(n), torch.zeros(n), torch.zeros(n), torch.randn(n).bfloat16()]
    hyper = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    x = _data(3 * 65536 + 129, torch.bfloat16, seed=3)
    want = _bits(sum_of_squares(x, backend="kernel", threads=2))
    stop = threading.Event()

    def adam_loop():
        while not stop.is_set():
            ha.host_adam_step(*state, None, adamw=True, threads=2, **hyper)

    worker = threading.Thread(target=adam_loop)
    worker.start()
    try:
        for _ in range(20):
            assert _bits(sum_of_squares(x, backend="kernel", threads=2)) == want
    finally:
        stop.set()
        worker.join()


class _CountingKernel:
    """The compiled module, recording the sizes its sum of squares was called with."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def __getattr__(self, name: str):
        return getattr(C, name)

    def sumsq(self, ptr: int, code: int, n: int, threads: int) -> float:
        self.sizes.append(n)
        return C.sumsq(ptr, code, n, threads)


@needs_kernel
def test_engine_norm_goes_through_the_kernel(monkeypatch):
    """CPU training, stage 2 + offload: every final segment's squared norm is the kernel's, and
    the step's global norm equals the one summed by torch within fp32 rounding."""
    from functools import partial

    from parity import batches, engine_config, make_model

    import zero_offload
    from zero_offload.runtime.reduce import grad_shard

    def run() -> tuple[float, int]:
        cfg = engine_config(2, True, 1, 2, 1.0, overlap=False, dtype="bf16")
        engine, *_ = zero_offload.initialize(model=make_model(), config=cfg)
        ((x, y),) = batches(1, 1, 1, 2)
        engine.backward(engine(x, y))
        engine.step()
        norm = engine.get_global_grad_norm()
        numel = sum(s.numel for gs in (og.grads for og in engine.opt_groups) for s in gs.segs)
        engine.destroy()
        return norm, numel

    counting = _CountingKernel()
    with monkeypatch.context() as m:
        m.setattr(sq, "_C", counting)
        norm, numel = run()
    assert counting.sizes and sum(counting.sizes) == numel  # every segment, once
    monkeypatch.setattr(grad_shard, "sum_of_squares", partial(sum_of_squares, backend="torch"))
    norm_torch, _ = run()
    assert norm == pytest.approx(norm_torch, rel=1e-5)
