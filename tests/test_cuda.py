"""CUDA paths: streams, pinned host buffers, overlap, device memory per parameter. Skipped
without an NVIDIA GPU."""

from __future__ import annotations

import copy

import pytest
import torch
from parity import batches, engine_config, make_model, run_cases

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize(
    "stage,offload", [(0, False), (1, False), (2, False), (1, True), (2, True)]
)
def test_cuda_parity_single_gpu(stage, offload):
    cases = [
        dict(stage=stage, offload=offload, gas=g, clip=0.05, overlap=ov, pin_memory=True)
        if offload
        else dict(stage=stage, offload=offload, gas=g, clip=0.05, overlap=ov)
        for g in (1, 2)
        for ov in (False, True)
    ]
    for r in run_cases(cases):
        assert r["grad_err"] < 1e-4, r["case"]
        assert r["param_err"] < 1e-3, r["case"]


def test_cuda_delayed_update_and_bf16_offload_runs():
    for extra in ({"delayed_update": True, "delayed_update_after": 1}, {}):
        cfg = engine_config(
            stage=2,
            offload=True,
            gas=1,
            micro=2,
            clip=1.0,
            overlap=True,
            dtype="bf16",
            pin_memory=True,
            **extra,
        )
        import zero_offload

        engine, *_ = zero_offload.initialize(model=make_model(), config=cfg)
        x = torch.randint(0, 32, (2, 5), device=engine.device)
        losses = []
        for _ in range(6):
            loss = engine(x, x)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        assert losses[-1] < losses[0]
        assert engine.opt_groups[0].grads.host[0].is_pinned()


def _clear_cublas_workspaces() -> None:
    """cuBLAS keeps a workspace per handle and stream, from the allocator, from the first matmul
    on: cleared, so that what a test measures does not depend on which test ran one first."""
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()


def test_cuda_offload_device_bytes_per_param():
    """Stage 2 + offload keeps 2 bytes/param of model state on the device, plus the reducer's
    pooled buffers (its reported peak); cuBLAS's workspaces are not counted (cleared before both
    readings), so the result does not depend on the tests before it."""
    import zero_offload

    torch.cuda.empty_cache()
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])
    cfg = engine_config(
        stage=2,
        offload=True,
        gas=1,
        micro=2,
        clip=1.0,
        overlap=True,
        dtype="bf16",
        bucket=1 << 20,
        pin_memory=True,
    )
    _clear_cublas_workspaces()
    base = torch.cuda.memory_allocated()
    engine, *_ = zero_offload.initialize(model=model, config=cfg)
    x = torch.randn(2, 1024, device=engine.device, dtype=torch.bfloat16)
    engine.backward(engine(x).float().square().mean())
    engine.step()
    rep = engine.memory_report()
    numel = sum(p.numel() for p in model.parameters())
    assert rep["device.params"] / numel < 2.01
    assert "device.master_shard" not in rep and "device.optimizer_state" not in rep
    states = sum(v for k, v in rep.items() if k.startswith("device."))
    pool = rep["peak.device.reduce_buffers"]  # the key the reducer reports (stage 2)
    assert 0 < pool <= 2 * ((1 << 20) + 4096) * 2, rep  # two buffers of one (padded) bucket, bf16
    _clear_cublas_workspaces()
    held = torch.cuda.memory_allocated() - base
    assert held <= states + pool + (16 << 20), (held, rep)


@pytest.mark.parametrize(
    "offload,offload_param", [(False, False), (True, False), (True, True), (False, True)]
)
def test_cuda_stage3_parity(offload, offload_param):
    """(False, True): the device update writes the pinned host param shard (device -> host)."""
    tiny = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 300}
    cases = [
        dict(
            stage=3,
            offload=offload,
            offload_param=offload_param,
            gas=g,
            clip=0.05,
            overlap=ov,
            zero_extra=tiny,
        )  # fmt: skip
        for g in (1, 2)
        for ov in (False, True)
    ]
    for r in run_cases(cases):
        assert r["grad_err"] < 1e-4, r["case"]
        assert r["param_err"] < 1e-3, r["case"]


def test_cuda_stage3_params_on_pinned_host_and_released():
    import zero_offload

    cfg = engine_config(stage=3, offload=True, gas=1, micro=2, clip=1.0, overlap=True,
                        dtype="bf16", offload_param=True)  # fmt: skip
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine, *_ = zero_offload.initialize(model=make_model(), config=cfg)
    assert all(s.is_pinned() for s in engine.param_store.shards)
    x = torch.randint(0, 32, (2, 5), device=engine.device)
    for _ in range(3):
        loss = engine(x, x)
        engine.backward(loss)
        engine.step()
    assert engine.param_store.live == 0
    assert all(p.numel() == 0 for p in engine.module.parameters())
    assert torch.isfinite(loss)


def test_cuda_large_pinned_buffer_is_registered_without_rounding():
    """A large pinned host buffer is page-locked in place: pinned (async copies work), and the
    process grows by its size, not by the next power of two (the caching host allocator's)."""
    from zero_offload.core.streams import REGISTER_MIN_BYTES, alloc_host

    def rss() -> int:
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmRSS:"))

    numel = 3 * REGISTER_MIN_BYTES // 4 // 2 * 3  # 1.5x the threshold, in fp32: not a power of 2
    # The CUDA context and the registration path first, so that the first test of a process
    # measures only the buffer (a context alone grows the process by hundreds of MiB).
    torch.zeros(1, device="cuda")
    alloc_host(REGISTER_MIN_BYTES // 4, torch.float32, pin=True)  # registered, then freed
    torch.cuda.synchronize()
    before = rss()
    buf = alloc_host(numel, torch.float32, pin=True)
    grown = rss() - before
    assert buf.is_pinned() and buf.numel() == numel
    assert grown < 1.1 * numel * 4, grown
    src = torch.randn(numel, device="cuda")
    buf.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(buf, src.cpu())


def test_cuda_failed_registration_falls_back_and_leaves_no_error_behind(monkeypatch):
    """A refused cudaHostRegister (here: the range is registered already) gives a pinned buffer
    from the caching allocator, and the runtime's last error it set is cleared: the next kernel
    launch does not raise it as its own."""
    from zero_offload.core import streams

    numel = streams.REGISTER_MIN_BYTES // 4
    held = streams.alloc_host(numel, torch.float32, pin=True)  # registered in place
    real = torch.cuda.cudart()

    class RegistersHeldAgain:
        def cudaHostRegister(self, ptr, nbytes, flags):
            return real.cudaHostRegister(held.data_ptr(), nbytes, flags)

        def __getattr__(self, name):
            return getattr(real, name)

    monkeypatch.setattr(torch.cuda, "cudart", lambda: RegistersHeldAgain())
    buf = streams.alloc_host(numel, torch.float32, pin=True)
    assert buf.is_pinned() and buf.data_ptr() != held.data_ptr()
    x = torch.zeros(4, device="cuda").add_(1)  # a kernel launch, checked by torch
    torch.cuda.synchronize()
    assert x.sum().item() == 4


def test_cuda_pinned_swap_buffers_are_aligned_and_exact():
    """NVMe swap buffers in pinned memory: 4096-byte aligned for direct I/O, and no extra page
    that would double a power-of-two buffer in the pinned allocator."""
    from zero_offload.nvme.io.aio import ALIGN, aligned_empty

    for nbytes in (ALIGN, 1 << 20, (1 << 20) + 5):
        buf = aligned_empty(nbytes, pin=True)
        assert buf.is_pinned() and buf.data_ptr() % ALIGN == 0
        assert buf.numel() == -(-nbytes // ALIGN) * ALIGN
        assert buf.untyped_storage().nbytes() in (buf.numel(), buf.numel() + ALIGN)


def test_cuda_delayed_update_uploads_land_before_staging_is_rewritten():
    """flush's async uploads read the pinned staging buffer; the delayed host pass submitted
    right after it rewrites staging. Held behind a busy compute stream, the uploads must still
    carry what flush meant to upload, not the next pass's values."""
    import zero_offload

    cfg = engine_config(stage=2, offload=True, gas=1, micro=2, clip=0.0, overlap=True,
                        dtype="bf16", pin_memory=True, delayed_update=True,
                        delayed_update_after=0)  # fmt: skip
    engine, *_ = zero_offload.initialize(model=make_model(), config=cfg)
    so = engine.opt_groups[0].optimizer
    staging = so.staging.buffer  # the delayed update's own whole staging buffer
    assert so.staging.kind == "whole" and staging.is_pinned()
    uploaded = []
    host_pass, prepare_write = so.host_pass, so.home.prepare_write

    def spy_host_pass(grad, factor, h, upload, *rest):
        uploaded.append(staging.clone())  # staging as the preceding flush uploaded it
        return host_pass(grad, factor, h, upload, *rest)

    def slow_prepare_write():  # flush's uploads wait for the compute stream: hold it ~0.2 s
        torch.cuda._sleep(400_000_000)
        prepare_write()

    so.host_pass, so.home.prepare_write = spy_host_pass, slow_prepare_write
    x = torch.randint(0, 32, (2, 5), device=engine.device)
    for _ in range(2):  # step 1 starts pass 1; step 2 uploads it and starts pass 2
        engine.backward(engine(x, x))
        engine.step()
    so.runner._pending.result()
    torch.cuda.synchronize()
    assert not torch.equal(uploaded[1], staging)  # pass 2 did rewrite staging
    assert torch.equal(engine.opt_groups[0].flat.flat, uploaded[1])


def test_cuda_stage3_zero_init_parity():
    """zero.Init on the GPU: rank 0's values broadcast, chunks kept on the device, gathered back
    one param at a time into the engine's own layout."""
    case = dict(stage=3, offload=True, offload_param=True, gas=1, clip=0.05, overlap=True)
    for r in run_cases([dict(case, init=True)]):
        assert r["grad_err"] < 1e-4 and r["param_err"] < 1e-3, r["case"]


@pytest.mark.parametrize(
    "case",
    [
        dict(stage=1, offload=False, dtype="fp32"),
        dict(stage=2, offload=True, dtype="bf16", pin_memory=True),
        dict(stage=3, offload=False, dtype="fp16"),
        dict(stage=3, offload=True, offload_param=True, dtype="bf16"),
    ],
)
def test_cuda_checkpoint_roundtrip(case, tmp_path):
    """Save on the GPU (device or host master, stage-3 params gathered to the host, the CUDA
    generator) and load into a fresh engine: same masters, module, counters, CUDA RNG state, and
    both continue alike."""
    import zero_offload
    from zero_offload.utils import safe_get_full_fp32_param

    cfg = engine_config(gas=1, micro=2, clip=1.0, overlap=True, **case)
    data = batches(4, 1, 1, 2)

    def build():
        engine, *_ = zero_offload.initialize(model=make_model(), config=copy.deepcopy(cfg))
        return engine

    def run(engine, steps):
        out = []
        for x, y in steps:
            loss = engine(x.to(engine.device), y.to(engine.device))
            engine.backward(loss)
            engine.step()
            out.append(float(loss.detach()))
        return out

    def state(engine):
        named = dict(engine.module.named_parameters())
        master = {n: safe_get_full_fp32_param(p).cpu() for n, p in named.items() if p.requires_grad}
        with engine.params_on_host():
            module = {k: v.detach().cpu().clone() for k, v in engine.module.state_dict().items()}
        return master, module

    a = build()
    run(a, data[:2])
    saved = state(a)
    torch.cuda.manual_seed(1234)
    cuda_rng = torch.cuda.get_rng_state()
    a.save_checkpoint(str(tmp_path))
    torch.cuda.manual_seed(5678)
    b = build()
    b.load_checkpoint(str(tmp_path))
    assert torch.equal(torch.cuda.get_rng_state(), cuda_rng)
    loaded = state(b)
    for want, got in zip(saved, loaded):
        assert want.keys() == got.keys()
        for k in want:
            assert torch.equal(want[k], got[k]), k
    assert (b.global_steps, b.micro_steps, b.loss_scale) == (a.global_steps, a.micro_steps,
                                                             a.loss_scale)  # fmt: skip
    assert run(b, data[2:]) == pytest.approx(run(a, data[2:]), rel=1e-3)


def test_cuda_nvme_offload_equals_host_offload(tmp_path):
    """The optimizer state on NVMe (stages 2 and 3) and the stage-3 params too, on the GPU with
    pinned swap buffers (uploads straight from them): within parity of plain PyTorch, and
    bitwise the same run with host offload."""
    from test_nvme_offload import _cases

    cases = [dict(c, pin_memory=True) for c in _cases(str(tmp_path), 1) if c["stage"] >= 2]
    results = run_cases(cases)
    for host, nvme in zip(results[::2], results[1::2]):
        case = nvme["case"]
        assert nvme["case"]["offload"] == "nvme" and host["case"]["offload"] == "cpu"
        if case["dtype"] == "fp32":
            assert nvme["grad_err"] < 1e-4, case
            assert nvme["param_err"] < 1e-3, case
        assert host["losses"] == nvme["losses"], case
        for n, t in host["params"].items():
            assert torch.equal(t, nvme["params"][n]), (case, n)
        assert any(k.startswith("nvme.") for k in nvme["memory"]), nvme["memory"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_nvme_many_chunks_equal_host_offload(tmp_path, dtype):
    """Both states on NVMe over a dozen update chunks, pinned record buffers, a param cache
    smaller than the model and fetches served by the read-ahead: bitwise host offload."""
    from test_nvme_offload import _mlp_run

    want = _mlp_run(tmp_path, "cpu", dtype, 3, pin=True)
    got = _mlp_run(tmp_path / "swap", "nvme", dtype, 3, pin=True)
    assert got[0] == want[0]
    assert torch.equal(got[1], want[1])


def test_cuda_pinned_bytes_count_what_the_host_allocator_holds():
    """``host_bytes`` of a small pinned buffer is the caching host allocator's own count of the
    block it holds (a power of two); a registered large one counts its exact size."""
    from zero_offload.core.pinned_bytes import REGISTER_MIN_BYTES, host_bytes
    from zero_offload.core.streams import alloc_host

    torch.zeros(1, device="cuda")
    active = torch.cuda.host_memory_stats()["active_bytes.current"]
    small = alloc_host(1250, torch.float32, pin=True)  # 5000 bytes
    assert small.is_pinned() and host_bytes(small) == 8192
    assert torch.cuda.host_memory_stats()["active_bytes.current"] - active == 8192
    numel = REGISTER_MIN_BYTES // 4 + 1000
    big = alloc_host(numel, torch.float32, pin=True)
    assert big.is_pinned() and host_bytes(big) == numel * 4
    assert torch.cuda.host_memory_stats()["active_bytes.current"] - active == 8192
