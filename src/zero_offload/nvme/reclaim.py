"""Swap folders of runs that died without cleaning up (SIGKILL, OOM killer, a node reset) are
reclaimed when the next run starts on the same ``nvme_path``.

A run's folder is ``<nvme_path>/zero_offload_swap/<host>-pid<pid>-<random>/``
(``placement.run_name``). It is removed only when all of these hold, so a live run's files are
never touched:
- ``<host>`` is this host's name and process ``<pid>`` does not exist here;
- no swap file in it is held: a live run keeps a shared ``flock`` on each of its swap files
  (``file_guard.hold``), which the kernel drops when the process dies, so a run in another pid
  namespace that happens to share the host name is still seen as alive.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import shutil
import socket
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("zero_offload")

SWAP_ROOT = "zero_offload_swap"
RUN_FOLDER = re.compile(r"(?P<host>.+)-pid(?P<pid>\d+)-[0-9a-f]{12}")


@dataclass
class Reclaimed:
    removed: list[Path] = field(default_factory=list)
    freed: int = 0  # bytes the removed folders held on disk
    left: list[tuple[Path, int, str]] = field(default_factory=list)  # (folder, bytes, why kept)


def disk_bytes(folder: Path) -> int:
    """Bytes the files under ``folder`` take on disk (allocated blocks)."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass  # removed meanwhile
    return total


def _why_alive(folder: Path, host: str) -> str | None:
    """Why ``folder`` must be kept, or None when its run is dead (see the module's rules)."""
    m = RUN_FOLDER.fullmatch(folder.name)
    if m is None:
        return "not a run folder"
    if m["host"] != host:
        return f"of host {m['host']}"
    try:
        os.kill(int(m["pid"]), 0)
        return f"process {m['pid']} is running"
    except ProcessLookupError:
        pass
    except PermissionError:
        return f"process {m['pid']} is running"
    if _held(folder):
        return "its swap files are in use"
    return None


def _held(folder: Path) -> bool:
    for path in folder.rglob("*.swp"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return True
        finally:
            os.close(fd)  # closing drops the probe's own lock
    return False


def reclaim_dead_runs(nvme_path: Path) -> Reclaimed:
    """Remove the swap folders of dead runs of this host under ``nvme_path``; one log line
    says how much was reclaimed. What is kept is listed in the result (with why)."""
    out = Reclaimed()
    root = Path(nvme_path) / SWAP_ROOT
    if not root.is_dir():
        return out
    host = socket.gethostname()
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        why = _why_alive(folder, host)
        size = disk_bytes(folder)
        if why is None:
            shutil.rmtree(folder, ignore_errors=True)  # another rank may be removing it too
            if not folder.exists():
                out.removed.append(folder)
                out.freed += size
                continue
            why = "could not be removed"
        out.left.append((folder, size, why))
    if out.removed:
        log.warning(
            "%s: removed %d swap folder(s) of runs on this host that ended without cleaning "
            "up (their processes are gone): %.2f GiB reclaimed",
            root,
            len(out.removed),
            out.freed / (1 << 30),
        )
    return out
