"""Tests of the NVMe offload I/O engine (zero_offload.nvme.io.aio and the compiled zero_offload._aio).

Both backends run every round trip: ``cpp`` (C++ threads; skipped if the module did not build)
and ``python`` (the thread-pool fallback), chosen with ZERO_OFFLOAD_AIO. No test depends on
timing. Data are fresh random bytes on every run; the seed is printed (ZO_TEST_SEED replays).
"""

from __future__ import annotations

import errno
import gc
import os
import stat
import threading
import warnings
from pathlib import Path

import pytest
import torch

from zero_offload.nvme.io import aio
from zero_offload.nvme.io.aio import (
    ALIGN,
    AioEngine,
    AioPolicy,
    SwapFile,
    aligned_empty,
    measure_disk_bandwidth,
)

C = aio._C
BLOCK = 64 * 1024  # small pieces: many blocks without big files


@pytest.fixture(autouse=True)
def _no_ambient_backend(monkeypatch):
    monkeypatch.delenv("ZERO_OFFLOAD_AIO", raising=False)


@pytest.fixture(params=["cpp", "python"])
def backend(request, monkeypatch) -> str:
    if request.param == "cpp" and C is None:
        pytest.skip(f"zero_offload._aio did not build: {aio._IMPORT_ERROR}")
    monkeypatch.setenv("ZERO_OFFLOAD_AIO", request.param)
    return request.param


@pytest.fixture
def gen() -> torch.Generator:
    seed = int(os.environ.get("ZO_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"ZO_TEST_SEED={seed}")
    return torch.Generator().manual_seed(seed)


def random_buffer(nbytes: int, gen: torch.Generator) -> torch.Tensor:
    buf = aligned_empty(nbytes)
    buf.copy_(torch.randint(0, 256, (buf.numel(),), dtype=torch.uint8, generator=gen))
    return buf


def engine(threads: int = 2, block_size: int = BLOCK) -> AioEngine:
    return AioEngine(AioPolicy(block_size=block_size, threads=threads))


# ------------------------------------------------------------------------------------------------
# Round trips
# ------------------------------------------------------------------------------------------------

SIZES = {
    "one_block": BLOCK,
    "many_blocks": 9 * BLOCK,
    "not_block_multiple": 3 * BLOCK + 5 * ALIGN,
    "less_than_block": ALIGN,
}


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("size", list(SIZES), ids=list(SIZES))
def test_round_trip(backend, threads, size, tmp_path, gen):
    nbytes = SIZES[size]
    eng = engine(threads)
    assert eng.backend == ("pthreads" if backend == "cpp" else "python-threads")
    with SwapFile.create(tmp_path / "swap", nbytes + 2 * ALIGN) as f:
        data = random_buffer(nbytes, gen)
        w = eng.write(f, ALIGN, data)
        w.wait()
        assert w.done()
        out = aligned_empty(nbytes)
        out.zero_()
        r = eng.read(f, ALIGN, out)
        r.wait()
        assert r.done()
        assert torch.equal(out, data)
        # the bytes landed where asked: nothing before the offset was written
        head = aligned_empty(ALIGN)
        head.fill_(1)
        eng.read(f, 0, head).wait()
        assert not head.any()
    eng.close()


def test_round_trip_other_dtypes(backend, tmp_path, gen):
    eng = engine(2)
    n = 3 * BLOCK // 4  # float32 elements: 3 blocks
    with SwapFile.create(tmp_path / "swap", 2 * n * 4) as f:
        src = aligned_empty(n * 4).view(torch.float32)
        src.copy_(torch.randn(n, generator=gen))
        half = aligned_empty(n * 2).view(torch.bfloat16)
        half.copy_(torch.randn(n, generator=gen))
        reqs = [eng.write(f, 0, src), eng.write(f, n * 4, half)]
        for req in reqs:
            req.wait()
        back = aligned_empty(n * 4).view(torch.float32)
        back_half = aligned_empty(n * 2).view(torch.bfloat16)
        reqs = [eng.read(f, 0, back), eng.read(f, n * 4, back_half)]
        for req in reqs:
            req.wait()
        assert torch.equal(back, src) and torch.equal(back_half, half)


def test_many_requests_in_flight(backend, tmp_path, gen):
    eng = engine(3)
    count, nbytes = 16, 2 * BLOCK + ALIGN
    with SwapFile.create(tmp_path / "swap", count * nbytes) as f:
        bufs = [random_buffer(nbytes, gen) for _ in range(count)]
        writes = [eng.write(f, i * nbytes, b) for i, b in enumerate(bufs)]
        for req in reversed(writes):  # completion order does not matter
            req.wait()
        outs = [aligned_empty(nbytes) for _ in range(count)]
        reads = [eng.read(f, i * nbytes, o) for i, o in enumerate(outs)]
        for req in reads:
            req.wait()
        for b, o in zip(bufs, outs):
            assert torch.equal(b, o)


def test_concurrent_submitters(backend, tmp_path, gen):
    """Two Python threads submit and wait on one engine and one file, on disjoint regions."""
    eng = engine(2)
    rounds, nbytes = 8, 3 * BLOCK
    datas = [[random_buffer(nbytes, gen) for _ in range(rounds)] for _ in range(2)]
    errors: list[BaseException] = []
    with SwapFile.create(tmp_path / "swap", 2 * rounds * nbytes) as f:

        def worker(t: int) -> None:
            try:
                base = t * rounds * nbytes
                for i, data in enumerate(datas[t]):
                    eng.write(f, base + i * nbytes, data).wait()
                outs = [aligned_empty(nbytes) for _ in range(rounds)]
                reqs = [eng.read(f, base + i * nbytes, o) for i, o in enumerate(outs)]
                for req, out, data in zip(reqs, outs, datas[t]):
                    req.wait()
                    assert torch.equal(out, data)
            except BaseException as e:  # reported by the main thread
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    assert not errors, errors


def test_zero_bytes(backend, tmp_path):
    eng = engine(1)
    with SwapFile.create(tmp_path / "swap", ALIGN) as f:
        req = eng.write(f, 0, aligned_empty(0))
        req.wait()
        assert req.done()


# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------


def test_misaligned_direct_io_is_refused(backend, tmp_path):
    eng = engine(1)
    with SwapFile.create(tmp_path / "swap", 4 * ALIGN) as f:
        if not f.direct:
            pytest.skip("the temporary directory's filesystem refuses O_DIRECT")
        raw = aligned_empty(3 * ALIGN)
        with pytest.raises(ValueError, match="buffer address 0x[0-9a-f]+ not a multiple of 4096"):
            eng.read(f, 0, raw[1 : 1 + ALIGN])
        with pytest.raises(ValueError, match="byte count 100 not a multiple"):
            eng.write(f, 0, raw[:100])
        with pytest.raises(ValueError, match="file offset 512 not a multiple"):
            eng.write(f, 512, raw[:ALIGN])
        with pytest.raises(ValueError, match=r"past the end of swap file .*swap \(16384 bytes\)"):
            eng.write(f, 2 * ALIGN, raw)
        with pytest.raises(ValueError, match="contiguous"):
            eng.write(f, 0, raw.view(-1, 2)[:, 0])
        with pytest.raises(ValueError, match="offset must be an int >= 0"):
            eng.write(f, -ALIGN, raw[:ALIGN])


@pytest.mark.parametrize("cut", [2 * ALIGN, 2 * ALIGN + 100], ids=["aligned", "unaligned"])
def test_read_past_end_of_file(backend, cut, tmp_path, gen):
    eng = engine(2, block_size=ALIGN)
    path = tmp_path / "swap"
    with SwapFile.create(path, 4 * ALIGN) as f:
        eng.write(f, 0, random_buffer(4 * ALIGN, gen)).wait()
        os.truncate(path, cut)  # under the engine
        req = eng.read(f, 0, aligned_empty(4 * ALIGN))
        with pytest.raises(OSError) as info:
            req.wait()
        msg = str(info.value)
        assert info.value.errno == errno.EIO
        assert str(path) in msg and "end of file" in msg
        assert "read of 16384 bytes at offset 0" in msg
        with pytest.raises(OSError, match="end of file"):  # the same error on every wait
            req.wait()
        assert req.done()
        # what is before the cut still reads
        head = aligned_empty(2 * ALIGN)
        eng.read(f, 0, head).wait()


def test_write_error_names_file(backend, tmp_path):
    """A descriptor that cannot write: the C/pthread error path, errno and all."""
    path = tmp_path / "swap"
    SwapFile.create(path, 2 * ALIGN).close()
    fd = os.open(path, os.O_RDONLY)
    f = SwapFile(path, fd, 2 * ALIGN, direct=False)
    try:
        req = engine(2, block_size=ALIGN).write(f, ALIGN, aligned_empty(ALIGN))
        with pytest.raises(OSError) as info:
            req.wait()
        assert info.value.errno == errno.EBADF
        msg = str(info.value)
        assert f"write of {ALIGN} bytes at offset {ALIGN} of swap file {path}" in msg
    finally:
        f.close()


def test_removed_file(backend, tmp_path, gen):
    eng = engine(1)
    path = tmp_path / "swap"
    f = SwapFile.create(path, ALIGN)
    eng.write(f, 0, random_buffer(ALIGN, gen)).wait()
    f.unlink()
    assert not path.exists() and f.fd == -1
    with pytest.raises(ValueError, match=f"swap file {path} is closed"):
        eng.read(f, 0, aligned_empty(ALIGN))
    never = tmp_path / "never_created"
    with pytest.raises(FileNotFoundError, match=str(never)):
        SwapFile.open(never)


def test_enospc_names_file_and_bytes(tmp_path, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    path = tmp_path / "swap"
    with pytest.raises(OSError) as info:
        SwapFile.create(path, 5 * ALIGN - 1)
    assert info.value.errno == errno.ENOSPC
    msg = str(info.value)
    assert str(path) in msg and "20480 bytes" in msg and "no space left" in msg
    assert not path.exists()  # nothing left behind


def test_buffered_fallback_when_o_direct_refused(backend, tmp_path, monkeypatch, gen):
    real_open = os.open

    def no_direct(path, flags, *args, **kwargs):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_direct)
    with SwapFile.create(tmp_path / "swap", 3 * ALIGN) as f:
        assert f.direct is False
        monkeypatch.setattr(os, "open", real_open)
        eng = engine(2, block_size=1000)  # buffered: no alignment needed
        raw = random_buffer(2 * ALIGN + 2, gen)
        data = raw[1 : 1 + 5000]
        eng.write(f, 7, data).wait()
        out = torch.zeros(5000, dtype=torch.uint8)
        eng.read(f, 7, out).wait()
        assert torch.equal(out, data)


def test_tmpfs_round_trip(backend, gen):
    """tmpfs refused O_DIRECT (EINVAL) before Linux 6.6 and accepts it since: either way a swap
    file there works (buffered when refused)."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm")
    path = shm / f"zero_offload_test_aio.{os.getpid()}"
    try:
        with SwapFile.create(path, 2 * ALIGN) as f:
            eng = engine(2, block_size=ALIGN)
            data = random_buffer(2 * ALIGN, gen)
            eng.write(f, 0, data).wait()
            out = aligned_empty(2 * ALIGN)
            eng.read(f, 0, out).wait()
            assert torch.equal(out, data)
    finally:
        path.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------------
# Pieces of the API
# ------------------------------------------------------------------------------------------------


def test_swap_file_create_and_open(tmp_path):
    path = tmp_path / "swap"
    path.write_bytes(b"x" * 10)
    os.chmod(path, 0o644)
    with SwapFile.create(path, ALIGN + 1) as f:
        assert f.nbytes == 2 * ALIGN and f.path == path and f.fd >= 0
        assert os.path.getsize(path) == 2 * ALIGN
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert f.fd == -1
    f.close()  # idempotent
    with SwapFile.open(path) as g:
        assert g.nbytes == 2 * ALIGN
    g.unlink()
    g.unlink()  # already gone: no error
    assert not path.exists()


def test_aligned_empty():
    for n in (0, 1, ALIGN, ALIGN + 1, 3 * ALIGN - 7):
        t = aligned_empty(n)
        assert t.dtype == torch.uint8 and t.is_contiguous() and t.device.type == "cpu"
        assert t.numel() == -(-n // ALIGN) * ALIGN
        if n:
            assert t.data_ptr() % ALIGN == 0
    with pytest.raises(ValueError):
        aligned_empty(-1)


def test_policy_validation():
    assert AioPolicy() == AioPolicy(1 << 20, 8, 1, False, True)
    for bad in ({"threads": 0}, {"block_size": 0}, {"queue_depth": -1}, {"threads": 1.5}):
        with pytest.raises(ValueError, match="AioPolicy"):
            AioPolicy(**bad)


def test_dropped_request_is_waited(backend, tmp_path, gen):
    eng = engine(2)
    with SwapFile.create(tmp_path / "swap", 4 * BLOCK) as f:
        before = C.pending() if C is not None else 0
        eng.write(f, 0, random_buffer(4 * BLOCK, gen))  # never waited explicitly
        gc.collect()
        assert len(f._pending) == 0
        if C is not None:
            assert C.pending() == before
        req = eng.read(f, 0, aligned_empty(4 * BLOCK))
        assert len(f._pending) == 1
    assert req.done()  # close() waited for it
    req.wait()


def test_fallback_warns_once(tmp_path, monkeypatch, gen):
    monkeypatch.setattr(aio, "_C", None)
    monkeypatch.setattr(aio, "_IMPORT_ERROR", "ImportError: No module named 'zero_offload._aio'")
    monkeypatch.setattr(aio, "_fallback_warned", False)
    with pytest.warns(RuntimeWarning, match=r"zero_offload\._aio.*No module named"):
        eng = AioEngine(AioPolicy(threads=2, block_size=BLOCK))
    assert eng.backend == "python-threads"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = AioEngine()
    assert again.backend == "python-threads"
    with SwapFile.create(tmp_path / "swap", 2 * BLOCK) as f:
        data = random_buffer(2 * BLOCK, gen)
        eng.write(f, 0, data).wait()
        out = aligned_empty(2 * BLOCK)
        eng.read(f, 0, out).wait()
        assert torch.equal(out, data)
    monkeypatch.setenv("ZERO_OFFLOAD_AIO", "cpp")
    with pytest.raises(RuntimeError, match="ZERO_OFFLOAD_AIO=cpp"):
        AioEngine()
    monkeypatch.setenv("ZERO_OFFLOAD_AIO", "uring")
    with pytest.raises(ValueError, match="ZERO_OFFLOAD_AIO"):
        AioEngine()


@pytest.mark.skipif(C is None, reason="zero_offload._aio did not build")
def test_c_module_api(tmp_path):
    assert C.backend() == "pthreads"
    assert isinstance(C.io_uring_available(), bool)
    rid = C.submit(0, 0, 0, 0, False, BLOCK, 1)  # nothing to transfer: complete at once
    assert C.done(rid)
    C.wait(rid)
    with pytest.raises(ValueError, match="unknown aio request id"):
        C.wait(rid)  # consumed
    with pytest.raises(ValueError, match="unknown aio request id"):
        C.done(rid)
    with pytest.raises(ValueError, match="threads"):
        C.submit(0, 0, 0, 0, False, BLOCK, 0)
    with pytest.raises(ValueError, match="block_size"):
        C.submit(0, 0, 0, 0, False, 0, 1)
    buf = aligned_empty(ALIGN)
    with SwapFile.create(tmp_path / "swap", ALIGN) as f:
        C.wait(C.submit(f.fd, buf.data_ptr(), ALIGN, 0, True, ALIGN, 3))
    assert C.pool_threads()[3] == 3


def test_measure_disk_bandwidth(backend, tmp_path):
    res = measure_disk_bandwidth(tmp_path, 2 * BLOCK + 1, AioPolicy(block_size=BLOCK, threads=2))
    assert res["nbytes"] == 2 * BLOCK + ALIGN and res["verified"] is True
    for key in ("write_gbps", "read_gbps", "baseline_write_gbps", "baseline_read_gbps"):
        assert res[key] > 0
    assert res["backend"] == ("pthreads" if backend == "cpp" else "python-threads")
    assert list(tmp_path.iterdir()) == []  # the scratch file is removed


def test_a_missing_compiled_module_is_named():
    from zero_offload._native import load_optional

    mod, why = load_optional("zero_offload._not_built")
    assert mod is None and "No module named 'zero_offload._not_built'" in why
    mod, why = load_optional("zero_offload._aio")
    assert (mod is None) == (aio._C is None)


def test_queue_depth_sets_the_requests_in_flight(backend, tmp_path, gen):
    """threads x queue_depth pieces at the disk at once, as DeepSpeed's libaio threads keep
    them: the engine runs that many workers (queue_depth used to be ignored: one per thread)."""
    policy = AioPolicy(block_size=BLOCK, threads=2, queue_depth=3)
    assert policy.workers == 6
    assert AioPolicy(threads=1, queue_depth=1).workers == 1
    assert AioPolicy(threads=64, queue_depth=64).workers == 1024  # the compiled pool's limit
    eng = AioEngine(policy)
    with SwapFile.create(tmp_path / "swap", 12 * BLOCK) as f:
        data = random_buffer(12 * BLOCK, gen)
        eng.write(f, 0, data).wait()
        out = aligned_empty(12 * BLOCK)
        eng.read(f, 0, out).wait()
        assert torch.equal(out, data)
    if eng.backend == "pthreads":
        assert C.pool_threads()[6] == 6
    else:
        assert eng._pool._max_workers == 6
    eng.close()


def test_an_urgent_read_goes_before_the_queued_requests(tmp_path):
    """One worker, a long normal write queued first: an urgent read's pieces run next, so it
    completes while most of the write is still queued (a param fetch does not wait behind the
    optimizer state's read-ahead)."""
    if C is None or not aio._URGENT:
        pytest.skip("the compiled module with urgent requests is not built")
    big, small = 1024 * ALIGN, ALIGN
    eng = AioEngine(AioPolicy(block_size=ALIGN, queue_depth=1, threads=1))
    with SwapFile.create(tmp_path / "swap", big + small) as f:
        src = aligned_empty(big)
        src.fill_(3)
        out = aligned_empty(small)
        slow = eng.write(f, 0, src)  # 1024 pieces, one at a time
        fast = eng.read(f, big, out, urgent=True)
        fast.wait()
        assert not slow.done()  # the read did not wait for the write's queued pieces
        slow.wait()


def test_urgent_is_ignored_by_a_build_without_it(tmp_path, monkeypatch):
    monkeypatch.setattr(aio, "_URGENT", False)  # an older compiled module: plain FIFO
    eng = engine()
    buf = aligned_empty(ALIGN)
    with SwapFile.create(tmp_path / "swap", ALIGN) as f:
        eng.read(f, 0, buf, urgent=True).wait()
