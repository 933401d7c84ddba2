"""The memory counters of DeepSpeed's accelerator object (``memory_allocated`` and its peers),
which DeepSpeed's tests and RLHF trainers read around ``engine.offload_states()``: torch's
caching-allocator counters on CUDA; on the CPU, as DeepSpeed's CPU accelerator, the process's
resident set size (its peak since the last reset as the maximum)."""

from __future__ import annotations

import os

import torch


def _rss() -> int:
    """Resident bytes of this process (Linux ``/proc``; 0 where it is not available)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class MemoryCounters:
    """Mixed into the accelerator; ``_name`` is "cuda" or "cpu"."""

    _name: str
    _peak_rss: int = 0

    def _cpu(self) -> int:
        now = _rss()
        self._peak_rss = max(self._peak_rss, now)
        return now

    def memory_allocated(self, device_index=None) -> int:
        if self._name == "cuda":
            return torch.cuda.memory_allocated(device_index)
        return self._cpu()

    def max_memory_allocated(self, device_index=None) -> int:
        if self._name == "cuda":
            return torch.cuda.max_memory_allocated(device_index)
        self._cpu()
        return self._peak_rss

    def memory_reserved(self, device_index=None) -> int:
        if self._name == "cuda":
            return torch.cuda.memory_reserved(device_index)
        return self._cpu()

    def max_memory_reserved(self, device_index=None) -> int:
        if self._name == "cuda":
            return torch.cuda.max_memory_reserved(device_index)
        self._cpu()
        return self._peak_rss

    def reset_peak_memory_stats(self, device_index=None) -> None:
        if self._name == "cuda":
            torch.cuda.reset_peak_memory_stats(device_index)
        else:
            self._peak_rss = _rss()

    def reset_max_memory_allocated(self, device_index=None) -> None:
        self.reset_peak_memory_stats(device_index)
