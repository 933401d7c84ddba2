"""Errors of NVMe offload: each names the swap file and what was being done with it."""

from __future__ import annotations


class NvmeSwapError(RuntimeError):
    """A swap file could not be read or written, or disappeared under the run."""
