"""Run a function on N gloo ranks (spawned processes) and collect every rank's return value.

Ranks start from a fork server that imported torch and zero_offload once per test process
(``ZERO_OFFLOAD_TEST_START=spawn`` starts each rank as a fresh interpreter instead): a rank is
then a fork, not an interpreter start-up and a torch import (about 3 s of 2 cores per call).
Isolation is the same as a fresh process for what a test can change: each rank gets the
caller's environment at call time (not the server's), and the server never runs any code past
its imports (no process group, no threads of its own, no CUDA context). What a module reads
from the environment at import (``ZERO_OFFLOAD_ISA``) is the server's: tests that vary it run
their own interpreter.
"""

from __future__ import annotations

import atexit
import gc
import io
import os
import socket
import time
import traceback

import torch.multiprocessing as mp

_PRELOAD = ["torch", "torch.distributed", "zero_offload.runtime.engine.engine", "distributed"]
_context = None


def _start_context():
    """The fork server's context, created once; ``spawn`` where asked for."""
    global _context
    if _context is None:
        if os.environ.get("ZERO_OFFLOAD_TEST_START", "forkserver") == "spawn":
            _context = mp.get_context("spawn")
        else:
            _context = mp.get_context("forkserver")
            _context.set_forkserver_preload(_PRELOAD)
    return _context


def _with_env(env: dict, target, *args) -> None:
    """Run ``target(*args)`` under the caller's environment as it was at the call, then the
    process's exit handlers: a forked rank ends in ``os._exit``, which would skip them (an
    interpreter's normal exit runs them: ``weakref.finalize``, ``atexit`` clean-ups)."""
    os.environ.clear()
    os.environ.update(env)
    try:
        target(*args)
    finally:
        atexit._run_exitfuncs()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args, queue) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        out = fn(*args)
        buf = io.BytesIO()  # bytes, not shared-memory tensors: they must outlive this process
        torch.save(out, buf)
        queue.put((rank, "ok", buf.getvalue()))
        del out
        gc.collect()  # engines (hooks, async work handles) go while the process group lives
        dist.barrier()
        from zero_offload.core.dist import shutdown

        shutdown()  # lets gloo's threads release their tensors before the interpreter exits
    except BaseException:
        queue.put((rank, "error", f"rank {rank}:\n{traceback.format_exc()}"))
        raise


def run_ranks(world: int, fn, *args, timeout: float = 1200):
    """Spawn ``world`` gloo ranks running ``fn(*args)``; return rank 0's result (every rank
    must finish without error; ``every_rank`` returns them all)."""
    return every_rank(world, fn, *args, timeout=timeout)[0]


def every_rank(world: int, fn, *args, timeout: float = 1200) -> list:
    """Spawn ``world`` gloo ranks running ``fn(*args)``; return the list of every rank's result,
    indexed by rank. Any rank's error fails the call with that rank's traceback."""
    ctx = _start_context()
    queue = ctx.SimpleQueue()
    port = _free_port()
    env = dict(os.environ)
    procs = [
        ctx.Process(target=_with_env, args=(env, _entry, r, world, port, fn, args, queue))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    got: dict[int, tuple[str, object]] = {}
    # read before join: a large result blocks the pipe; an error ends the wait (peers may hang)
    while len(got) < world and time.monotonic() < deadline:
        if not queue.empty():
            rank, status, out = queue.get()
            got[rank] = (status, out)
            if status != "ok":
                break
        elif not any(p.is_alive() for p in procs):
            break
        else:
            time.sleep(0.05)
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()) if len(got) == world else 5.0)
    for p in procs:
        if p.is_alive():
            p.kill()
    errors = [out for status, out in got.values() if status != "ok"]
    if errors:
        raise AssertionError("\n".join(errors))
    if len(got) < world:
        raise RuntimeError(
            f"results from ranks {sorted(got)} of {world} "
            f"(exit codes {[p.exitcode for p in procs]})"
        )
    if any(p.exitcode != 0 for p in procs):
        raise AssertionError(f"rank exit codes {[p.exitcode for p in procs]}")
    import torch

    return [torch.load(io.BytesIO(got[r][1]), weights_only=False) for r in range(world)]


def short_timeout_after_start_up(seconds: float) -> None:
    """Every rank is past start-up (process group, engine built); from here the collectives
    time out after ``seconds``. Start-up keeps the long timeout it was given, so a rank slow to
    start on a loaded machine cannot change which collective times out."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _set_pg_timeout

    dist.barrier()
    _set_pg_timeout(datetime.timedelta(seconds=seconds), None)


def answer_of(world: int, target, rank: int = 0, limit: float = 900) -> str:
    """Spawn ``world`` processes running ``target(rank, port, queue)``, each free to put
    ``(rank, message)`` on the queue and ``os._exit``; return ``rank``'s message, then kill
    them all. For runs whose ranks end in a failure (a frozen peer, a timeout) rather than in
    an orderly teardown; ``limit`` seconds is a hang guard only."""
    ctx = _start_context()
    queue = ctx.SimpleQueue()
    port = _free_port()
    env = dict(os.environ)
    procs = [
        ctx.Process(target=_with_env, args=(env, target, r, port, queue)) for r in range(world)
    ]
    for p in procs:
        p.start()
    got, t0 = {}, time.monotonic()
    while rank not in got and time.monotonic() - t0 < limit:
        if not queue.empty():
            r, msg = queue.get()
            got[r] = msg
        time.sleep(0.05)
    for p in procs:
        p.kill()
        p.join()
    return got.get(rank, f"no answer from rank {rank}")
