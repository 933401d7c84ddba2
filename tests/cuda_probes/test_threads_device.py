"""GPU probe: threads that touch CUDA run on the engine's device. With two GPUs an engine on
GPU 1 (``LOCAL_RANK=1``) runs delayed updates and drops a registered pinned buffer from another
thread in a fresh process, which must end with no CUDA context on GPU 0. One GPU cannot show a
context made on the wrong device; there the probe checks only that the worker thread's current
device is the engine's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

TESTS = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import sys, threading, torch
sys.path.insert(0, sys.argv[1])
import zero_offload
from parity import engine_config, make_model
from zero_offload.core.streams import alloc_host

cfg = engine_config(2, True, 1, 2, 0.0, overlap=True, dtype="bf16", pin_memory=True,
                    delayed_update=True, delayed_update_after=1)
engine, *_ = zero_offload.initialize(model=make_model(), config=cfg)
x = torch.randint(0, 32, (2, 5), device=engine.device)
for _ in range(4):
    engine.backward(engine(x, x))
    engine.step()
seen = engine._executor.submit(torch.cuda.current_device).result()
engine.flush_delayed_update()
box = [alloc_host(32 << 20, torch.float32, pin=True)]  # 128 MiB: registered in place
t = threading.Thread(target=box.clear)  # the finalizer runs on this thread
t.start(); t.join()
engine.destroy()
print("WORKER_DEVICE", seen, "ENGINE_DEVICE", engine.device.index)
if torch.cuda.device_count() > 1:
    print("CONTEXT_ON_0", torch._C._cuda_hasPrimaryContext(0))
"""


def _run(local_rank: int) -> str:
    env = {**os.environ, "LOCAL_RANK": str(local_rank)}
    env.pop("WORLD_SIZE", None)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(TESTS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_worker_thread_runs_on_the_engine_device():
    """On one GPU only the worker's device is checked (it is GPU 0 either way); with two, the
    engine on GPU 1 must leave GPU 0 without a context. Not a skip: the GPU run treats any
    skip of a cuda test as a failure."""
    out = _run(0)
    assert "WORKER_DEVICE 0 ENGINE_DEVICE 0" in out
    if torch.cuda.device_count() >= 2:
        out = _run(1)
        assert "WORKER_DEVICE 1 ENGINE_DEVICE 1" in out
        assert "CONTEXT_ON_0 False" in out
