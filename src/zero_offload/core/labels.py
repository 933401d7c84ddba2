"""Profiler labels: stable names for the engine's phases in a ``torch.profiler`` trace.

``label(name)`` is a ``torch.profiler.record_function`` range while a torch profiler (or
``emit_nvtx``) runs, and a shared no-op context otherwise: the check is one read of torch's
process-wide "a profiler is on" flag, so the hot path pays nothing when nobody profiles.

The names (listed in docs/architecture.md) are what ``benchmarks/_trace.py`` looks for; renaming
one breaks the overlap benchmark.

torch.profiler records ranges only on the thread that started it and on autograd's threads. The
delayed update's host pass runs on a worker thread of its own, so its ``host_update`` ranges are
missing from a trace (``benchmarks/overlap_trace.py`` records that thread's spans itself).
"""

from __future__ import annotations

import contextlib

import torch.autograd.profiler as _profiler

REDUCE = "zero_offload.reduce"  # issuing one bucket's gradient collective (reducer.py)
GRAD_D2H = "zero_offload.grad_d2h"  # issuing one final grad segment's device->host copy
GRAD_WAIT = "zero_offload.grad_wait"  # the host waiting for the grad copies before the update
HOST_UPDATE = "zero_offload.host_update"  # the host Adam pass over one chunk
PARAM_H2D = "zero_offload.param_h2d"  # issuing one chunk's updated-param upload
FETCH = "zero_offload.fetch"  # stage 3: issuing one slot's gather (h2d of the own slice too)

ALL = (REDUCE, GRAD_D2H, GRAD_WAIT, HOST_UPDATE, PARAM_H2D, FETCH)

_OFF = contextlib.nullcontext()


def label(name: str) -> contextlib.AbstractContextManager:
    """A profiler range named ``name`` while a profiler runs; a no-op context otherwise."""
    if getattr(_profiler, "_is_profiler_enabled", True):  # a torch without the flag: always
        return _profiler.record_function(name)
    return _OFF
