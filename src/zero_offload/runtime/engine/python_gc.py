"""DeepSpeed's ``disable_python_gc``: Python's automatic cyclic garbage collection off while an
engine that asked for it lives (a collection pause in the middle of a step stalls every rank),
collected once first; ``engine.collect_python_gc()`` collects at a point the caller chooses.

Process-wide and shared: several engines may ask; automatic collection comes back (if it was on
before the first) when the last of them is destroyed.
"""

from __future__ import annotations

import gc
import logging
import threading

log = logging.getLogger("zero_offload")


class PythonGC:
    """Counts the engines holding automatic collection off."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._restore = False

    def acquire(self) -> None:
        with self._lock:
            if self._holders == 0:
                self._restore = gc.isenabled()
                if self._restore:
                    collected = gc.collect()
                    gc.disable()
                    log.info("automatic Python GC off (collected %d objects first)", collected)
            self._holders += 1

    def release(self) -> None:
        with self._lock:
            if self._holders == 0:
                return
            self._holders -= 1
            if self._holders == 0 and self._restore and not gc.isenabled():
                gc.enable()
                log.info("automatic Python GC restored")

    @property
    def holders(self) -> int:
        return self._holders


PYTHON_GC = PythonGC()
