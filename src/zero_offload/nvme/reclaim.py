"""Swap folders of runs that died without cleaning up (SIGKILL, OOM killer, a node reset) are
reclaimed when the next run starts on the same ``nvme_path``.

A run's folder is ``<nvme_path>/zero_offload_swap/<host>-pid<pid>-<random>/``
(``placement.run_name``). It is removed only when all of these hold, so a live run's files are
never touched:
- ``<host>`` is this host's name and process ``<pid>`` does not exist here;
- no swap file in it is held: a live run keeps a shared ``flock`` on each of its swap files
  (``file_guard.hold``), which the kernel drops when the process dies, so a run in another pid
  namespace that happens to share the host name is still seen as alive.

Several processes may reclaim under one ``nvme_path`` at once (the ranks of a node, two jobs
sharing a drive). They take turns on the swap root's lock (``swap_root.py``), so the second
finds the first's work done, and a live run's folder is never seen before its swap files are
held. Where that lock is not available, every step still tolerates another reclaimer's
concurrent work: an entry that vanished was reclaimed by it, and is neither an error nor
counted as this call's.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import shutil
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .swap_root import SWAP_ROOT, WAIT_S, reclaiming

log = logging.getLogger("zero_offload")

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
    """Some swap file under ``folder`` is held by a live process (``os.walk`` skips what
    vanishes while it walks: another reclaimer removing the folder)."""
    for root, _, files in os.walk(folder):
        for name in files:
            if name.endswith(".swp") and _locked(os.path.join(root, name)):
                return True
    return False


def _locked(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False  # removed meanwhile
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        return e.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    finally:
        os.close(fd)  # closing drops the probe's own lock
    return False


def _remove(folder: Path) -> str | None:
    """Remove ``folder``; None when it is gone (whoever removed which part), else why not.
    Entries that vanish underneath were removed by another reclaimer: not an error."""
    problems: list[str] = []

    def onexc(_fn, path, exc: BaseException) -> None:
        if not isinstance(exc, FileNotFoundError):
            problems.append(f"{path}: {getattr(exc, 'strerror', None) or exc}")

    if sys.version_info >= (3, 12):
        shutil.rmtree(folder, onexc=onexc)
    else:
        shutil.rmtree(folder, onerror=lambda fn, path, info: onexc(fn, path, info[1]))
    if not os.path.lexists(folder):
        return None
    return "could not be removed" + (f" ({problems[0]})" if problems else "")


def reclaim_dead_runs(nvme_path: Path, wait_s: float = WAIT_S) -> Reclaimed:
    """Remove the swap folders of dead runs of this host under ``nvme_path``; one log line
    says how much was reclaimed. What is kept is listed in the result (with why). Safe to call
    from several processes at once (see the module's rules): taking turns, each dead folder is
    in the result of the one call that removed it."""
    out = Reclaimed()
    root = Path(nvme_path) / SWAP_ROOT
    if not root.is_dir():
        return out
    with reclaiming(root, wait_s):
        host = socket.gethostname()
        for folder in _run_folders(root):
            why = _why_alive(folder, host)
            size = disk_bytes(folder)
            if not os.path.lexists(folder):
                continue  # reclaimed by another process meanwhile
            if why is None:
                why = _remove(folder)
                if why is None:
                    out.removed.append(folder)
                    out.freed += size
                    continue
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


def _run_folders(root: Path) -> list[Path]:
    """The folders in ``root`` now (none if it vanished)."""
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    out = []
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                out.append(Path(entry.path))
        except OSError:
            pass  # removed meanwhile
    return sorted(out)


def kept_runs(nvme_path: Path, wait_s: float = WAIT_S) -> Reclaimed:
    """The run folders under ``nvme_path`` and why each is there, removing nothing: what a rank
    that did not reclaim this path itself names in its free-space error."""
    out = Reclaimed()
    root = Path(nvme_path) / SWAP_ROOT
    if not root.is_dir():
        return out
    with reclaiming(root, wait_s):  # two probes at once would see each other's lock
        host = socket.gethostname()
        for folder in _run_folders(root):
            why = _why_alive(folder, host) or "its run has ended, not removed"
            out.left.append((folder, disk_bytes(folder), why))
    return out
