"""NVMe offload (ZeRO-Infinity): optimizer state and (stage 3) the param shard in swap files.

Parity: stages 1-3 with the optimizer on NVMe, stage 3 with the params on NVMe too, fp32 and
bf16, GAS 2, clipping, 1 and 2 gloo ranks: within the parity tolerances of plain PyTorch, and
bitwise equal to the same run with host offload (same kernel, same chunks). The streamed state
equals an in-memory state over many chunks and every buffer count. Faults: a failed write or
read, a full disk, a removed or truncated swap file: an error naming the file, the committed
master weights unchanged, the last checkpoint intact.
"""

from __future__ import annotations

import copy
import errno
import os
from pathlib import Path

import pytest
import torch
from distributed import run_ranks
from parity import batches, engine_config, global_step, make_model, run_cases

from zero_offload.config.errors import ConfigError
from zero_offload.core.state.shard_state import KINDS, MemoryState
from zero_offload.nvme.errors import NvmeSwapError
from zero_offload.nvme.io.aio import AioEngine, AioPolicy
from zero_offload.nvme.optimizer_state import NvmeOptimizerState
from zero_offload.nvme.param_shard import NvmeParamShard

GRAD_TOL, PARAM_TOL = 1e-5, 1e-3
S3 = {"stage3_param_persistence_threshold": 0}


def _cases(path: str, world: int) -> list[dict]:
    out = []
    setups = (
        [(2, False), (3, False), (3, "nvme")]
        if world > 1
        else [(1, False), (2, False), (3, False), (3, "nvme")]
    )
    for stage, param in setups:
        for dtype in ("fp32", "bf16") if world == 1 else ("bf16",):
            for dev in ("cpu", "nvme"):
                out.append(
                    dict(
                        stage=stage,
                        offload=dev,
                        offload_param=param if dev == "nvme" or not param else "cpu",
                        gas=2,
                        clip=0.05,
                        overlap=False,
                        dtype=dtype,
                        nvme_path=path,
                        zero_extra=S3 if stage == 3 else None,
                    )
                )
    return out


def _check(results: list[dict]) -> None:
    for host, nvme in zip(results[::2], results[1::2]):
        case = nvme["case"]
        if case["dtype"] == "fp32":
            assert nvme["grad_err"] < GRAD_TOL, case
            assert nvme["param_err"] < PARAM_TOL, case
        # The same kernel over the same chunks: NVMe changes where the state lives, not a bit.
        for n, t in host["params"].items():
            assert torch.equal(t, nvme["params"][n]), (case, n)
        assert host["losses"] == nvme["losses"], case
        assert any(k.startswith("nvme.") for k in nvme["memory"]), nvme["memory"]
        assert not any(k.startswith("host.master") for k in nvme["memory"]), nvme["memory"]


def test_parity_world1(tmp_path):
    _check(run_cases(_cases(str(tmp_path), 1)))


def test_parity_world2(tmp_path):
    _check(run_ranks(2, run_cases, _cases(str(tmp_path), 2)))
    assert not any(tmp_path.rglob("*.swp")), "swap files outlived their processes"


# ---- the streamed state against the in-memory one ------------------------------------------------
@pytest.mark.parametrize("buffers", [2, 3, 4, 6])
def test_streamed_state_equals_memory(tmp_path, buffers):
    numel, chunk = 5 * 2048 + 777, 2048
    aio = AioEngine(AioPolicy(block_size=8192, threads=2))
    nv = NvmeOptimizerState(tmp_path, "g", numel, chunk, buffers, aio, pin=False)
    mem = MemoryState(numel, torch.device("cpu"), "host", moments=True)
    init = torch.randn(numel)
    nv.fill(lambda lo, hi, out: out.copy_(init[lo:hi]))
    mem.master.copy_(init)
    chunks = [(lo, min(lo + chunk, numel)) for lo in range(0, numel, chunk)]
    for step in range(3):
        g = torch.randn(numel)

        def body(lo, hi, v, g=g, step=step):
            v["exp_avg"].mul_(0.9).add_(g[lo:hi])
            v["exp_avg_sq"].mul_(0.99).addcmul_(g[lo:hi], g[lo:hi])
            v["master"].sub_(0.01 * (step + 1) * v["exp_avg"])

        nv.update(chunks, body)
        mem.update(chunks, body)
    for kind in KINDS:
        assert torch.equal(nv.read(kind, 0, numel), mem.read(kind, 0, numel)), kind
        assert torch.equal(nv.read(kind, 3000, 7000), mem.read(kind, 3000, 7000)), kind
    # element writes across chunk boundaries, cached and flushed by the next read
    piece = torch.randn(4000)
    nv.write("exp_avg", 1500, piece)
    mem.write("exp_avg", 1500, piece)
    assert torch.equal(nv.read("exp_avg", 0, numel), mem.read("exp_avg", 0, numel))
    nv.close()
    assert not nv.file.path.exists()


def test_param_shard_reads_writes_and_cache(tmp_path):
    aio = AioEngine(AioPolicy())
    numel = 10_000
    nv = NvmeParamShard(tmp_path, "p", numel, torch.bfloat16, aio, pin=False, max_in_cpu=3000)
    ref = torch.randn(numel).bfloat16()
    for lo in range(0, numel, 777):  # unaligned pieces: read-modify-write of covering blocks
        nv.write(lo, ref[lo : lo + 777])
    assert torch.equal(nv.read(0, numel), ref)
    for lo, hi in [(5, 1000), (1000, 2999), (2999, 3000), (4000, 6500)]:
        nv.read_ahead(lo, hi)
    assert nv.cached <= 3000  # max_in_cpu bounds the cache
    for lo, hi in [(5, 1000), (4000, 6500), (1000, 2999)]:
        assert torch.equal(nv.read(lo, hi), ref[lo:hi])
    nv.write(900, torch.zeros(200, dtype=torch.bfloat16))  # drops the cached slices it overlaps
    ref[900:1100] = 0
    assert torch.equal(nv.read(5, 1000), ref[5:1000])
    nv.close()


def test_param_shard_host_buffers_stay_within_max_in_cpu(tmp_path):
    """The cache and the buffers kept for reuse together: at most max_in_cpu elements (each
    distinct slice size used to keep two buffers of its own, whatever the limit)."""
    aio = AioEngine(AioPolicy())
    nv = NvmeParamShard(tmp_path, "p", 40_000, torch.bfloat16, aio, pin=False, max_in_cpu=6000)
    nv.write(0, torch.randn(40_000).bfloat16())
    lo = 0
    for n in range(2500, 3800, 100):  # distinct sizes, each read into the cache then evicted
        nv.read(lo, lo + n)
        lo += n
    kept = sum(b.numel() for bufs in nv._spare.values() for b in bufs) // 2
    assert nv.cached + kept <= 6000, (nv.cached, kept)
    report = nv.nbytes()
    assert report["host.param_cache"] + report["host.param_spares"] <= 6000 * 2
    nv.close()


@pytest.mark.parametrize("fail_at", [("read", 4), ("write", 3), ("write", 6), ("body", 2)])
def test_failed_update_commits_nothing(tmp_path, fail_at):
    """A failure at any chunk of a six-chunk update leaves every chunk's committed state, the
    last write's too (the update waits for every write before it commits)."""
    numel, chunk = 6 * 2048, 2048
    aio = AioEngine(AioPolicy())
    nv = NvmeOptimizerState(tmp_path, "g", numel, chunk, 3, aio, pin=False)
    init = torch.randn(numel)
    nv.fill(lambda lo, hi, out: out.copy_(init[lo:hi]))
    chunks = [(lo, lo + chunk) for lo in range(0, numel, chunk)]
    what, n = fail_at
    calls = {"read": 0, "write": 0, "body": 0}
    real = {"read": aio.read, "write": aio.write}

    def io(op):
        def call(f, offset, buf):
            calls[op] += 1
            return (
                _Failing(errno.EIO) if op == what and calls[op] == n else real[op](f, offset, buf)
            )

        return call

    aio.read, aio.write = io("read"), io("write")

    def body(lo, hi, v):
        calls["body"] += 1
        if what == "body" and calls["body"] == n:
            raise RuntimeError("kernel failed")
        v["master"].add_(1.0)
        v["exp_avg"].add_(1.0)

    with pytest.raises((NvmeSwapError, RuntimeError)):
        nv.update(chunks, body)
    aio.read, aio.write = real["read"], real["write"]
    assert torch.equal(nv.read("master", 0, numel), init)
    assert torch.equal(nv.read("exp_avg", 0, numel), torch.zeros(numel))
    nv.update(chunks, body)  # and the next update works from the committed state
    assert torch.equal(nv.read("master", 0, numel), init + 1)
    nv.close()


# ---- engines: checkpoints, errors, faults ------------------------------------------------------
def _engine(path: Path, optimizer: str = "nvme", param: str | bool = False, stage: int = 3, **zero):
    import zero_offload

    path.mkdir(parents=True, exist_ok=True)
    cfg = engine_config(
        stage=stage,
        offload=optimizer,
        gas=1,
        micro=2,
        clip=0.05,
        overlap=False,
        offload_param=param,
        nvme_path=str(path),
        zero_extra={**(S3 if stage == 3 else {}), **zero},
    )
    engine, *_ = zero_offload.initialize(model=make_model(), config=copy.deepcopy(cfg))
    if stage == 3:
        assert all(p.numel() == 0 < p.ds_numel for p in engine.module.parameters())
    return engine


def _train(engine, steps: range) -> list[float]:
    data = batches(max(steps) + 1, 1, 1, 2)
    return [global_step(engine, *data[i]) for i in steps]


def _params(engine) -> torch.Tensor:
    """The 16-bit params (fp32 here) in the master's order: gathered, this rank's pieces."""
    out = []
    for so in (og.optimizer for og in engine.opt_groups):
        out.append(so.home.read(0, so.state.numel).float().cpu())
    return torch.cat(out)


def _two_group_engine(path: Path):
    """Stage 2, GAS 2, two param groups (decay and no decay), optimizer on NVMe."""
    import zero_offload

    path.mkdir(parents=True, exist_ok=True)
    model = make_model()
    cfg = engine_config(
        stage=2, offload="nvme", gas=2, micro=1, clip=0.05, overlap=False, nvme_path=str(path)
    )
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() <= 1]
    groups = [{"params": decay}, {"params": rest, "weight_decay": 0.0}]
    engine, *_ = zero_offload.initialize(model=model, model_parameters=groups, config=cfg)
    return engine


def _one_rank_fails(root: str) -> list:
    """Rank 1's write fails in group 0 of a step: both ranks raise (no rank waits in a
    collective), keep the last step, and a retry of the same batch then equals a run that
    never failed."""
    from zero_offload.core import dist

    rank, data = dist.rank(), batches(4, 2, 2, 1)
    clean = _two_group_engine(Path(root) / f"clean{rank}")
    for i in range(4):
        global_step(clean, *data[i], world=2, rank=rank)
    want = _master(clean)
    clean.destroy()

    engine = _two_group_engine(Path(root) / f"swap{rank}")
    for i in range(2):
        global_step(engine, *data[i], world=2, rank=rank)
    before = _master(engine)
    real = engine.aio.write
    if rank == 1:
        engine.aio.write = lambda *a: _Failing(errno.EIO)
    try:
        global_step(engine, *data[2], world=2, rank=rank)
        raised = None
    except NvmeSwapError as e:
        raised = str(e)
    engine.aio.write = real
    out = {
        "raised": raised,
        "kept": torch.equal(_master(engine), before),
        "params": torch.equal(_params(engine), before),
        "steps": [so.step_count for so in (og.optimizer for og in engine.opt_groups)],
    }
    for i in (2, 3):  # the retry
        global_step(engine, *data[i], world=2, rank=rank)
    out["retry_equal"] = torch.equal(_master(engine), want)
    engine.destroy()
    both = [None, None]
    torch.distributed.all_gather_object(both, out)
    return both


def test_failure_on_one_rank_rolls_back_every_rank(tmp_path):
    results = run_ranks(2, _one_rank_fails, str(tmp_path), timeout=300)
    assert "other rank" in results[0]["raised"] and "failed" in results[1]["raised"], results
    assert all(r["kept"] and r["params"] for r in results), results
    assert all(r["steps"] == [2, 2] for r in results), results
    assert all(r["retry_equal"] for r in results), results


def _master(engine) -> torch.Tensor:
    return torch.cat(
        [
            so.state.read("master", 0, so.state.numel).cpu()
            for so in (og.optimizer for og in engine.opt_groups)
        ]
    )


@pytest.mark.parametrize("param", [False, "nvme"])
def test_checkpoint_moves_between_nvme_and_host(tmp_path, param):
    """Saved from NVMe, resumed on the host, and the other way: bitwise the uninterrupted run."""
    straight = _engine(tmp_path / "swap", "cpu")
    full = _train(straight, range(4))
    want = _master(straight)
    straight.destroy()
    for first, second in (("nvme", "cpu"), ("cpu", "nvme")):
        a = _engine(tmp_path / "swap", first, param if first == "nvme" else False)
        head = _train(a, range(2))
        a.save_checkpoint(tmp_path / f"ck-{first}")
        a.destroy()
        b = _engine(tmp_path / "swap", second, param if second == "nvme" else False)
        b.load_checkpoint(tmp_path / f"ck-{first}")
        tail = _train(b, range(2, 4))
        assert head + tail == full, (first, second)
        assert torch.equal(_master(b), want), (first, second)
        b.destroy()
    assert not any((tmp_path / "swap").rglob("*.swp"))


class _Failing:
    """An aio request that fails like the disk would."""

    def __init__(self, err: int) -> None:
        self.err = err

    def wait(self) -> None:
        raise OSError(self.err, os.strerror(self.err))

    def done(self) -> bool:
        return True


@pytest.mark.parametrize(("op", "err"), [("write", errno.ENOSPC), ("read", errno.EIO)])
def test_io_error_mid_step_keeps_master_and_checkpoint(tmp_path, monkeypatch, op, err):
    engine = _engine(tmp_path / "swap")
    _train(engine, range(2))
    engine.save_checkpoint(tmp_path / "ck")
    before, steps = _master(engine), engine.opt_groups[0].optimizer.step_count
    calls = {"n": 0}
    real = getattr(engine.aio, op)

    def flaky(f, offset, buf):
        calls["n"] += 1
        return _Failing(err) if calls["n"] == 1 else real(f, offset, buf)

    monkeypatch.setattr(engine.aio, op, flaky)
    state = engine.opt_groups[0].optimizer.state
    with pytest.raises(NvmeSwapError, match=str(state.file.path).replace("\\", "\\\\")):
        _train(engine, range(2, 3))
    monkeypatch.undo()
    assert torch.equal(_master(engine), before), "a failed step changed the committed master"
    assert engine.opt_groups[0].optimizer.step_count == steps
    assert torch.equal(_params(engine), before), "the params are not the committed master's"
    engine.destroy()
    fresh = _engine(tmp_path / "swap")  # the last checkpoint loads and equals the state at save
    fresh.load_checkpoint(tmp_path / "ck")
    assert torch.equal(_master(fresh), before)
    fresh.destroy()


def test_removed_swap_file_is_named(tmp_path):
    engine = _engine(tmp_path / "swap")
    _train(engine, range(1))
    before, steps = _params(engine), engine.opt_groups[0].optimizer.step_count
    path = engine.opt_groups[0].optimizer.state.file.path
    path.unlink()
    with pytest.raises(NvmeSwapError, match="was removed while the run used it"):
        _train(engine, range(1, 2))
    assert torch.equal(_params(engine), before), "a failed step changed the weights"
    assert engine.opt_groups[0].optimizer.step_count == steps
    engine.destroy()


def test_param_swap_read_error_is_named(tmp_path, monkeypatch):
    engine = _engine(tmp_path / "swap", "nvme", "nvme")
    _train(engine, range(1))
    shard = engine.param_store.swapped[0]
    shard.drop_cached()
    monkeypatch.setattr(engine.aio, "read", lambda *a, **k: _Failing(errno.EIO))
    with pytest.raises(NvmeSwapError, match=r"param-shard .* failed"):
        _train(engine, range(1, 2))
    monkeypatch.undo()
    engine.destroy()


def test_bad_nvme_settings_fail_before_the_first_step(tmp_path):
    import zero_offload

    cfg = engine_config(
        stage=2,
        offload="nvme",
        gas=1,
        micro=2,
        clip=0.0,
        overlap=False,
        nvme_path=str(tmp_path / "file" / "no"),
    )
    (tmp_path / "file").write_text("x")  # a parent that is a file: the path cannot be created
    with pytest.raises(ConfigError, match=r"offload_optimizer\.nvme_path.*could not be created"):
        zero_offload.initialize(model=make_model(), config=cfg)
    (tmp_path / "ok").mkdir()
    with pytest.raises(ConfigError, match=r"offload_param\.buffer_size"):
        cfg = engine_config(
            stage=3,
            offload="nvme",
            gas=1,
            micro=2,
            clip=0.0,
            overlap=False,
            offload_param="nvme",
            nvme_path=str(tmp_path / "ok"),
            zero_extra=S3,
        )
        cfg["zero_optimization"]["offload_param"]["buffer_size"] = 10
        zero_offload.initialize(model=make_model(), config=cfg)


def test_param_nvme_keeps_params_partitioned_and_off_host(tmp_path):
    engine = _engine(tmp_path / "swap", "nvme", "nvme", stage3_max_live_parameters=10**9)
    model = engine.module
    assert all(p.numel() == 0 < p.ds_numel for p in model.parameters())
    assert all(s is None for s in engine.param_store.shards)
    assert all(p.ds_tensor.device.type == "meta" for p in model.parameters())
    report = engine.memory_report()
    assert "nvme.param_shard" in report and "host.param_shard" not in report
    _train(engine, range(2))
    engine.destroy()
    assert not any((tmp_path / "swap").rglob("*.swp"))


def test_module_only_load_keeps_moments_like_host_offload(tmp_path):
    """Loading weights alone rebuilds the master from them and keeps the Adam moments, on NVMe
    exactly as with host offload."""
    out = {}
    for where in ("cpu", "nvme"):
        engine = _engine(tmp_path / "swap", where)
        _train(engine, range(2))
        engine.save_checkpoint(tmp_path / f"ck-{where}")
        _train(engine, range(2, 3))
        engine.load_checkpoint(tmp_path / f"ck-{where}", load_module_only=True)
        st = engine.opt_groups[0].optimizer.state
        out[where] = [st.read(k, 0, st.numel).clone() for k in ("master", "exp_avg")]
        assert out[where][1].abs().sum() > 0  # the moments were kept, not zeroed
        engine.destroy()
    for a, b in zip(out["cpu"], out["nvme"]):
        assert torch.equal(a, b)


def test_bad_path_leaves_a_stage3_model_untouched(tmp_path):
    """Preflight runs before anything is partitioned: the model is handed back whole."""
    import zero_offload

    (tmp_path / "ok").mkdir()
    model = make_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = engine_config(
        stage=3, offload="nvme", offload_param="nvme", gas=1, micro=2, clip=0.0, overlap=False,
        nvme_path=str(tmp_path / "ok"), zero_extra=S3,
    )  # fmt: skip
    (tmp_path / "file").write_text("x")  # a parent that is a file: the path cannot be created
    cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(tmp_path / "file" / "missing")
    with pytest.raises(ConfigError, match=r"offload_optimizer\.nvme_path"):
        zero_offload.initialize(model=model, config=cfg)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n
    assert not any((tmp_path / "ok").rglob("*.swp"))


def _preflight_on_two_ranks(root: str) -> list:
    import zero_offload
    from zero_offload.core import dist

    path = Path(root) / ("ok" if dist.rank() == 0 else "file/missing")  # rank 1's: uncreatable
    cfg = engine_config(
        stage=2, offload="nvme", gas=1, micro=2, clip=0.0, overlap=False, nvme_path=str(path)
    )
    try:
        zero_offload.initialize(model=make_model(), config=cfg)
        got = None
    except ConfigError as e:
        got = str(e)
    both = [None, None]
    torch.distributed.all_gather_object(both, got)
    return both


def test_preflight_failure_on_one_rank_raises_on_every_rank(tmp_path):
    (tmp_path / "ok").mkdir()
    (tmp_path / "file").write_text("x")
    r0, r1 = run_ranks(2, _preflight_on_two_ranks, str(tmp_path))
    assert r0 is not None and "other rank" in r0, r0
    assert r1 is not None and "does not exist" in r1, r1


class _Mlp(torch.nn.Module):
    """~25K params: with sub_group_size 2048 the update runs over a dozen chunks per group."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(48, 48) for _ in range(10))
        self.norm = torch.nn.LayerNorm(48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.layers:
            x = x + torch.tanh(m(x))
        return self.norm(x).float().square().mean()


def _mlp_run(
    path: Path, where: str, dtype: str, buffers: int, pin: bool = False
) -> tuple[list, torch.Tensor]:
    import zero_offload

    torch.manual_seed(0)
    model = _Mlp()
    block = {"device": where, "pin_memory": pin}
    if where == "nvme":
        path.mkdir(parents=True, exist_ok=True)
        block |= {"nvme_path": str(path)}
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "sub_group_size": 2048,
            "stage3_prefetch_bucket_size": 0,  # so the slices come from the NVMe read-ahead
            "offload_optimizer": {**block, "buffer_count": buffers},
            "offload_param": {**block, "buffer_count": 2, "max_in_cpu": 5000},
        },
        "steps_per_print": 10**9,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine, *_ = zero_offload.initialize(model=model, config=cfg)
    assert all(p.numel() == 0 < p.ds_numel for p in model.parameters())
    if where == "nvme":
        assert len(engine.opt_groups[0].optimizer.chunks) >= 10
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(4):
        for _ in range(2):
            loss = engine(torch.randn(4, 48, generator=g).to(engine.device, engine.dtype))
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
    if where == "nvme":
        assert sum(nv.ahead_hits for nv in engine.param_store.swapped.values()) > 0
    master = _master(engine)
    params = _params(engine)
    engine.destroy()
    return losses, torch.cat([master, params])


def test_truncated_swap_file_is_named_and_keeps_the_weights(tmp_path):
    """The file cut after its first chunks: the swap-file guard names it (before any read of
    the step, or, were it cut between reads, after chunks 0-2 were updated: then the weights are
    unchanged only if the step is rolled back); either way the weights and step are kept."""
    import zero_offload

    torch.manual_seed(0)
    model = _Mlp()
    cfg = engine_config(3, "nvme", 1, 4, 0.5, overlap=False, nvme_path=str(tmp_path),
                        zero_extra={**S3, "sub_group_size": 2048})  # fmt: skip
    engine, *_ = zero_offload.initialize(model=model, config=cfg)
    assert all(p.numel() == 0 < p.ds_numel for p in model.parameters())
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 48, generator=g)
    engine.backward(engine(x))
    engine.step()
    state = engine.opt_groups[0].optimizer.state
    assert state.nchunks >= 10
    before, steps = _params(engine), engine.opt_groups[0].optimizer.step_count
    assert torch.equal(before, _master(engine))  # fp32: the params are the committed master
    os.truncate(state.file.path, 3 * 2 * state.record)  # chunks 0-2 stay whole
    engine.backward(engine(x))
    with pytest.raises(NvmeSwapError, match=f"{state.file.path}.*truncated"):
        engine.step()
    assert torch.equal(_params(engine), before), "a failed step changed the weights"
    assert engine.opt_groups[0].optimizer.step_count == steps
    engine.destroy()


@pytest.mark.parametrize(("dtype", "buffers"), [("fp32", 2), ("bf16", 3), ("bf16", 6)])
def test_many_chunks_equal_host_offload(tmp_path, dtype, buffers):
    """Both states on NVMe over many chunks (the read-ahead / write-behind pipeline, the param
    file written chunk by chunk, a param cache smaller than the model) train bitwise like host
    offload, with GAS 2 and clipping."""
    want = _mlp_run(tmp_path, "cpu", dtype, buffers)
    got = _mlp_run(tmp_path / "swap", "nvme", dtype, buffers)
    assert got[0] == want[0]
    assert torch.equal(got[1], want[1])
    assert not any((tmp_path / "swap").rglob("*.swp"))
