"""Start the ranks of one run as separate processes and collect what they wrote.

Each rank is a fresh ``python _step_worker.py`` with torchrun's environment, so the engine, torch
DDP and DeepSpeed all find their process group the same way (env://, gloo on the CPU). The cores
are split evenly between ranks by default (``OMP_NUM_THREADS``; the host Adam kernel splits them by
``LOCAL_WORLD_SIZE``), so world 1 and world 2 use the same machine.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _spec import Run, Shape, to_json

WORKER = Path(__file__).resolve().parent / "_step_worker.py"


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_env(rank: int, world: int, port: int, threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        LOCAL_SIZE=str(world),  # DeepSpeed's CPU accelerator: "devices" on this node
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS=str(threads),
        PYTHONWARNINGS="ignore",
    )
    return env


def _why(stderr: str) -> str:
    """The line of a failed rank's stderr that says what went wrong (its last exception line)."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for ln in reversed(lines):
        head = ln.split(":", 1)[0]
        if head.endswith(("Error", "Exception", "Interrupt")) or head.startswith("AssertionError"):
            return ln[:300]
    return (lines[-1] if lines else "no output")[:300]


def default_threads(world: int) -> int:
    return max(1, cores() // world)


def mem_available() -> int | None:
    """``MemAvailable`` of /proc/meminfo in bytes (None where there is no /proc)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _wait(procs: list[subprocess.Popen], timeout: float, host_reserve: int) -> str | None:
    """Wait for every rank; the reason if they had to be stopped: the deadline, or the host's
    available memory falling under ``host_reserve`` bytes (stopped before the kernel's OOM
    killer picks a victim, which could be any process of the machine)."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            return f"timed out after {timeout:.0f} s"
        avail = mem_available() if host_reserve else None
        if avail is not None and avail < host_reserve:
            return (
                f"host memory: stopped when available memory fell to {avail / 2**30:.1f} GiB "
                f"(reserve {host_reserve / 2**30:.1f} GiB)"
            )
        time.sleep(0.2)
    return None


def launch(
    shape: Shape,
    run: Run,
    timeout: float,
    threads: int | None = None,
    host_reserve: int = 0,
) -> dict[str, Any]:
    """Run all ranks, each with ``threads`` intra-op threads (default: the cores split evenly);
    return the rank results ``{"ranks": [...]}`` or ``{"error": "..."}``. With ``host_reserve``
    (bytes), the ranks are stopped when the host's available memory falls below it."""
    threads = threads or default_threads(run.world)
    spec = json.dumps(to_json(shape, run))
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="engine_step_") as tmp:
        outs = [Path(tmp) / f"rank{r}.json" for r in range(run.world)]
        errs = [open(Path(tmp) / f"rank{r}.err", "w+") for r in range(run.world)]  # noqa: SIM115
        procs = [
            subprocess.Popen(
                [sys.executable, str(WORKER), spec, str(outs[r])],
                env=_rank_env(r, run.world, port, threads),
                stdout=subprocess.DEVNULL,
                stderr=errs[r],
            )
            for r in range(run.world)
        ]
        stopped = _wait(procs, timeout, host_reserve)
        for p in procs:  # a rank whose peer died waits in a collective: end it
            if p.poll() is None:
                p.kill()
                p.wait()
        texts = []
        for f in errs:
            f.seek(0)
            texts.append(f.read())
            f.close()
        if stopped:
            return {"error": stopped}
        failed = [r for r, p in enumerate(procs) if p.returncode != 0 or not outs[r].exists()]
        if failed:
            r = failed[0]
            return {"error": f"rank {r} exit {procs[r].returncode}: {_why(texts[r])}"}
        return {"ranks": [json.loads(o.read_text()) for o in outs]}


def prebuild_deepspeed(timeout: float, ops: list[str]) -> str | None:
    """Build DeepSpeed's ``ops`` (``cpu_adam``, ``fused_adam``) once; the error line if it fails
    (then every DeepSpeed row says so)."""
    try:
        done = subprocess.run(
            [sys.executable, str(WORKER), "--prebuild-deepspeed", *ops],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
    except subprocess.TimeoutExpired:
        return f"building DeepSpeed's ops timed out after {timeout:.0f} s"
    if done.returncode != 0:
        return f"building DeepSpeed's ops failed: {_why(done.stderr)}"
    return None
