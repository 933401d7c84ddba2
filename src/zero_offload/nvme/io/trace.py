"""An opt-in timeline of the NVMe I/O: every request's submit and completion time and bytes, and
the engine's phase marks (forward, backward, step), so the disk's busy and idle time through a
training step can be read off (``summarize``; ``benchmarks/nvme_trace.py`` prints it).

Environment variable (read once, at the first request or mark):
    ZERO_OFFLOAD_NVME_TRACE  a file path: the timeline is written there as JSON lines at exit
                             (and by ``dump``); with several ranks (WORLD_SIZE > 1) each writes
                             ``<path>.rank<RANK>``. Unset: nothing is recorded, nothing runs.

Completion times come from a polling thread (every 0.2 ms) and from the wait that consumes the
request, whichever sees it first: a completion is stamped at most one poll late while the
poller gets the interpreter lock. Lines: ``{"op": "read"|"write", "file": name, "bytes": n,
"submit": t, "done": t}`` (with ``"stall": t``
when a thread began waiting for it at t before it completed: the I/O held that thread up) and ``{"mark": name, "t": t}``, times in seconds (``perf_counter``).
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

ENV = "ZERO_OFFLOAD_NVME_TRACE"
_POLL_S = 2e-4


class IoTrace:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.events: list[dict[str, Any]] = []
        self._open: dict[int, tuple[dict[str, Any], Any]] = {}  # polled: id -> (event, request)
        self._live: dict[int, dict[str, Any]] = {}  # not finished: id(request) -> event
        self._lock = threading.Lock()
        self._stop = False
        self._poller = threading.Thread(target=self._poll, name="zero_offload_io_trace")
        self._poller.daemon = True
        self._poller.start()
        atexit.register(self.dump)

    def submitted(self, request: Any) -> None:
        path = request.file.path  # its folder names the kind: optimizer/ or param/
        event = {"op": request.op, "file": f"{path.parent.name}/{path.name}"}
        event |= {"bytes": request.nbytes}
        event |= {"submit": time.perf_counter(), "done": None}
        with self._lock:
            self.events.append(event)
            self._open[id(request)] = (event, request)
            self._live[id(request)] = event

    def waiting(self, request: Any) -> float | None:
        """A thread starts waiting for ``request``: the time, when it is not done yet (the
        waiter stalls on the I/O), else None."""
        return None if request.done() else time.perf_counter()

    def finished(self, request: Any, began: float | None = None) -> None:
        """The request's wait returned: it completed by now (if the poller did not see it);
        ``began``: when the wait started, if it had to wait (recorded as ``"stall"``)."""
        now = time.perf_counter()
        with self._lock:
            self._open.pop(id(request), None)
            event = self._live.pop(id(request), None)
            if event is None:
                return
            if event["done"] is None:
                event["done"] = now
            if began is not None:
                event["stall"] = began

    def mark(self, name: str) -> None:
        with self._lock:
            self.events.append({"mark": name, "t": time.perf_counter()})

    def _poll(self) -> None:
        while not self._stop:
            with self._lock:
                items = list(self._open.items())
            for key, (event, request) in items:
                if request.done():
                    now = time.perf_counter()
                    with self._lock:
                        self._open.pop(key, None)
                        if event["done"] is None:
                            event["done"] = now
            time.sleep(_POLL_S)

    def dump(self) -> None:
        with self._lock:
            lines = [json.dumps(e) for e in self.events]
        self.path.write_text("\n".join(lines) + "\n")


_trace: IoTrace | None = None
_read = False


def tracer() -> IoTrace | None:
    """The process's trace, or None when ZERO_OFFLOAD_NVME_TRACE is unset."""
    global _trace, _read
    if not _read:
        _read = True
        path = os.environ.get(ENV, "").strip()
        if path:
            _trace = IoTrace(_per_rank(Path(path)))
    return _trace


def _per_rank(path: Path) -> Path:
    """``path``, or ``path.rank<r>`` when the launcher started several ranks (one file each)."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        return path.with_name(f"{path.name}.rank{os.environ.get('RANK', '0')}")
    return path


def mark(name: str) -> None:
    """A phase mark on the timeline (no-op without a trace)."""
    t = tracer()
    if t is not None:
        t.mark(name)
