"""Threads that touch CUDA run on the engine's device: the delayed update's worker binds it
first, and a registered pinned buffer's finalizer synchronizes and unregisters on the device it
was registered on. With CUDA simulated: the calls are recorded (tests/cuda_probes/ checks on a
GPU that no context appears where it should not)."""

from __future__ import annotations

import threading

import torch

from zero_offload.core import streams
from zero_offload.runtime.update.paths import host_worker

CUDA1 = torch.device("cuda", 1)


def test_worker_binds_the_engine_device_before_any_work(monkeypatch):
    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda d: calls.append((threading.current_thread().name, d))
    )
    monkeypatch.setattr(host_worker, "default_threads", lambda: 8)
    worker = host_worker.HostWorker(CUDA1, None)
    try:
        ran_on = worker.submit(lambda: threading.current_thread().name).result()
    finally:
        worker.shutdown()
    assert calls == [(ran_on, CUDA1)]
    assert ran_on != threading.current_thread().name


def test_worker_on_cpu_binds_nothing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: (_ for _ in ()).throw(AssertionError))
    worker = host_worker.HostWorker(torch.device("cpu"), None)
    try:
        assert worker.submit(lambda: 7).result() == 7
    finally:
        worker.shutdown()
    assert worker.threads is None  # the CPU path keeps the kernel's default


def test_worker_kernel_threads_leave_the_launch_threads_their_cores(monkeypatch):
    monkeypatch.setattr(host_worker, "default_threads", lambda: 8)
    assert host_worker.worker_threads(CUDA1, None) == 6
    assert host_worker.worker_threads(CUDA1, 3) == 3  # offload_optimizer's setting wins
    monkeypatch.setattr(host_worker, "default_threads", lambda: 2)
    assert host_worker.worker_threads(CUDA1, None) == 1  # never none
    assert host_worker.worker_threads(torch.device("cpu"), None) is None


def test_pinned_finalizer_syncs_and_unregisters_on_its_device(monkeypatch):
    log: list[tuple] = []

    class Device:
        def __init__(self, d):
            self.d = d

        def __enter__(self):
            log.append(("enter", self.d))

        def __exit__(self, *exc):
            log.append(("exit", self.d))

    class Cudart:
        def cudaHostUnregister(self, ptr):
            log.append(("unregister", ptr))
            return 0

    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: log.append(("sync", d)))
    monkeypatch.setattr(torch.cuda, "device", Device)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    streams._unregister(4096, 1)
    assert log == [("sync", 1), ("enter", 1), ("unregister", 4096), ("exit", 1)]


def test_release_pinned_cache_uses_what_torch_has(monkeypatch):
    calls = []
    monkeypatch.setattr(
        torch._C, "_accelerator_emptyHostCache", lambda: calls.append(1), raising=False
    )
    assert streams.release_pinned_cache() and calls == [1]
    monkeypatch.delattr(torch._C, "_accelerator_emptyHostCache", raising=False)
    monkeypatch.delattr(torch._C, "_host_emptyCache", raising=False)
    assert not streams.release_pinned_cache()  # an older torch: nothing to call, no error
