"""The delayed update's worker thread: bound to the engine's device, and with a kernel thread
count that leaves cores to the threads that keep the GPU busy meanwhile.

Invariants:
- the worker's first act is ``torch.cuda.set_device(engine device)``: its host pass synchronizes
  events and queues uploads, and a thread's current device starts as GPU 0, so on rank k > 0
  the first such call made a CUDA context on GPU 0 (~0.5 GiB per rank);
- on CUDA, while the worker runs the host kernel the main thread launches the next forward and
  backward and a framework thread (autograd's device thread) launches the backward's kernels:
  the kernel gets the process's cores minus those two (at least one). On the CPU the main
  thread's forward computes on the same cores either way, and nothing changes there.
"""

from __future__ import annotations

import concurrent.futures

import torch

from ....kernels import default_threads

LAUNCH_THREADS = 2  # the main thread and autograd's device thread, on CUDA


def worker_threads(device: torch.device, configured: int | None) -> int | None:
    """The host kernel's threads on the worker: the config's when given (``None``: the kernel's
    default, one per core); on CUDA the cores minus the two launch threads."""
    if configured is not None or device.type != "cuda":
        return configured
    return max(1, default_threads() - LAUNCH_THREADS)


def _bind(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)


class HostWorker(concurrent.futures.ThreadPoolExecutor):
    """One thread, bound to ``device`` before it runs anything; ``threads`` is the kernel
    thread count a host pass on it uses."""

    def __init__(self, device: torch.device, configured_threads: int | None) -> None:
        super().__init__(
            1, thread_name_prefix="zero-offload-host-update", initializer=_bind, initargs=(device,)
        )
        self.device = device
        self.threads = worker_threads(device, configured_threads)
