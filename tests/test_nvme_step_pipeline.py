"""The NVMe step's pipeline: the first records of the optimizer state are read while the backward
runs (``NvmeOptimizerState.read_ahead``), the update starts from them and equals an in-memory
state bitwise; a change of the committed state in between drops them."""

from __future__ import annotations

import torch

from zero_offload.core.state.shard_state import KINDS, MemoryState
from zero_offload.nvme.io.aio import AioEngine, AioPolicy
from zero_offload.nvme.optimizer_state import NvmeOptimizerState

NUMEL, CHUNK = 6 * 2048 + 501, 2048


def _states(tmp_path, buffers: int):
    aio = AioEngine(AioPolicy(block_size=8192, threads=2))
    nv = NvmeOptimizerState(tmp_path, "g", NUMEL, CHUNK, buffers, aio, pin=False)
    mem = MemoryState(NUMEL, torch.device("cpu"), "host", moments=True)
    init = torch.randn(NUMEL)
    nv.fill(lambda lo, hi, out: out.copy_(init[lo:hi]))
    mem.master.copy_(init)
    return nv, mem


def _body(step: int):
    g = torch.randn(NUMEL)

    def body(lo, hi, v):
        v["exp_avg"].mul_(0.9).add_(g[lo:hi])
        v["exp_avg_sq"].mul_(0.99).addcmul_(g[lo:hi], g[lo:hi])
        v["master"].sub_(0.01 * (step + 1) * v["exp_avg"])

    return body


def _count_reads(nv):
    calls = []
    real = nv.aio.read

    def read(*a):
        calls.append(a[1])
        return real(*a)

    nv.aio.read = read
    return calls


def test_update_starts_from_the_records_read_ahead(tmp_path):
    nv, mem = _states(tmp_path, buffers=4)
    chunks = [(lo, min(lo + CHUNK, NUMEL)) for lo in range(0, NUMEL, CHUNK)]
    calls = _count_reads(nv)
    for step in range(3):
        nv.read_ahead()  # as the step's backward begins
        assert len(calls) == len(chunks) * step + 4  # the whole pool, before the update
        body = _body(step)
        nv.update(chunks, body)
        mem.update(chunks, body)
    # each update read only the records not read ahead
    assert len(calls) == 3 * len(chunks)
    for kind in KINDS:
        assert torch.equal(nv.read(kind, 0, NUMEL), mem.read(kind, 0, NUMEL)), kind
    nv.close()


def test_a_write_after_the_read_ahead_drops_it(tmp_path):
    """A checkpoint load (element writes) between the read-ahead and the update: the update
    reads the written values, not the records read before."""
    nv, mem = _states(tmp_path, buffers=3)
    chunks = [(lo, min(lo + CHUNK, NUMEL)) for lo in range(0, NUMEL, CHUNK)]
    nv.read_ahead()
    piece = torch.randn(3000)
    nv.write("master", 100, piece)
    mem.write("master", 100, piece)
    body = _body(0)
    nv.update(chunks, body)
    mem.update(chunks, body)
    for kind in KINDS:
        assert torch.equal(nv.read(kind, 0, NUMEL), mem.read(kind, 0, NUMEL)), kind
    nv.close()


def test_engine_reads_the_state_ahead_during_the_backward(tmp_path):
    """Stage 3, both states on NVMe: after the boundary backward and before step(), the first
    records are in flight or read; the step then trains like host offload (the parity tests)."""
    import zero_offload

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    block = {"device": "nvme", "nvme_path": str(tmp_path)}
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "sub_group_size": 2048,
            "offload_optimizer": {**block, "buffer_count": 3},
            "offload_param": dict(block),
        },
        "steps_per_print": 10**9,
    }
    engine, *_ = zero_offload.initialize(model=model, config=cfg)
    assert all(p.numel() == 0 < p.ds_numel for p in engine.module.parameters())
    state = engine.opt_groups[0].optimizer.state
    x = torch.randn(2, 64)
    engine.backward(engine(x).square().mean())  # not the boundary: nothing read yet
    assert not state._early
    engine.step()
    engine.backward(engine(x).square().mean())
    assert sorted(state._early) == [0, 1, 2]  # buffer_count records
    engine.step()
    assert not state._early
    engine.destroy()


def test_bf16_update_writes_its_output_into_the_param_write_buffers(tmp_path, monkeypatch):
    """Both states on NVMe, bf16: the kernel's 16-bit output goes straight into the param
    file's write buffers (one per chunk), never through a staging copy and ``write``."""
    import zero_offload
    from zero_offload.nvme.param_shard import NvmeParamShard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    block = {"device": "nvme", "nvme_path": str(tmp_path)}
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "sub_group_size": 2048,
            "offload_optimizer": dict(block),
            "offload_param": dict(block),
        },
        "steps_per_print": 10**9,
    }
    engine, *_ = zero_offload.initialize(model=model, config=cfg)
    assert all(p.numel() == 0 < p.ds_numel for p in engine.module.parameters())
    calls = {"write": 0, "write_target": 0}
    for name in calls:
        real = getattr(NvmeParamShard, name)

        def counted(self, *a, _real=real, _name=name):
            calls[_name] += 1
            return _real(self, *a)

        monkeypatch.setattr(NvmeParamShard, name, counted)
    x = torch.randn(2, 64).bfloat16()
    engine.backward(engine(x).float().square().mean())
    engine.step()
    assert calls == {"write": 0, "write_target": len(engine.opt_groups[0].optimizer.chunks)}, calls
    engine.destroy()


def test_the_next_read_is_in_flight_before_each_chunk_computes(tmp_path):
    """The disk never waits for the kernel: chunk k+1's read is submitted before chunk k's body
    runs (a pool busy with writes gives the oldest write's buffer to it), with or without the
    records read ahead, for every pool size the config allows; the result equals the in-memory
    state."""
    for buffers in (2, 3, 4):
        nv, mem = _states(tmp_path / str(buffers), buffers=buffers)
        chunks = [(lo, min(lo + CHUNK, NUMEL)) for lo in range(0, NUMEL, CHUNK)]
        log: list[tuple[str, int]] = []
        real = nv.aio.read

        def read(f, off, buf, log=log, real=real, nv=nv):
            log.append(("read", off // (2 * nv.record)))
            return real(f, off, buf)

        nv.aio.read = read
        for step in range(2):
            if step:
                nv.read_ahead()
            log.clear()
            body = _body(step)

            def logged(lo, hi, v, body=body, log=log):
                log.append(("body", lo // CHUNK))
                body(lo, hi, v)

            nv.update(chunks, logged)
            mem.update(chunks, body)
            for k in range(len(chunks) - 1):
                assert ("read", k + 1) in log[: log.index(("body", k))] or (
                    step and k + 1 < buffers  # read ahead before the update
                ), (buffers, step, k, log)
        for kind in KINDS:
            assert torch.equal(nv.read(kind, 0, NUMEL), mem.read(kind, 0, NUMEL)), kind
        nv.close()


def test_param_reads_are_urgent_and_state_reads_are_not(tmp_path):
    """A param fetch (demanded or read ahead) goes to the disk before the queued optimizer-state
    reads; the state's own reads and every write stay in order."""
    from zero_offload.nvme.param_shard import NvmeParamShard

    aio = AioEngine(AioPolicy(block_size=8192))
    seen: list[tuple[str, bool]] = []
    real = aio.read

    def read(f, off, buf, urgent=False):
        seen.append((f.path.name, urgent))
        return real(f, off, buf, urgent=urgent)

    aio.read = read
    shard = NvmeParamShard(tmp_path, "p", 10_000, torch.bfloat16, aio, pin=False, max_in_cpu=8000)
    shard.write(0, torch.randn(10_000).bfloat16())
    shard.read_ahead(0, 2048)
    shard.read(2048, 4096)
    nv = NvmeOptimizerState(tmp_path, "g", NUMEL, CHUNK, 3, aio, pin=False)
    nv.fill(lambda lo, hi, out: out.zero_())
    nv.read_ahead()
    nv.update([(lo, min(lo + CHUNK, NUMEL)) for lo in range(0, NUMEL, CHUNK)], _body(0))
    assert {u for name, u in seen if name == "p.swp"} == {True}
    assert {u for name, u in seen if name == "g.swp"} == {False}
    shard.close()
    nv.close()
