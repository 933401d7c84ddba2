"""The lock on a swap root folder (``<nvme_path>/zero_offload_swap``), a ``flock`` of the folder
itself: a process reclaiming dead runs' folders there holds it exclusively (``reclaiming``), a
run making its swap folder and files holds it shared (``making``) until those files are held
(``file_guard.hold``). So reclaimers take turns (the second finds the first's work done), and no
reclaimer ever sees a live run's folder before its files are held: that hold is all that tells a
live run in another pid namespace from a dead one.

The lock is advisory and best-effort: where it cannot be had (a filesystem without ``flock``, a
holder stuck past ``WAIT_S``) the caller goes on without it, and the reclaim tolerates another
reclaimer's concurrent work (``reclaim.py``). The kernel drops it when its process dies.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger("zero_offload")

SWAP_ROOT = "zero_offload_swap"  # the folder under nvme_path that holds every run's folder
WAIT_S = 60.0  # longest wait for the lock (a reclaim removes folders in seconds)
RETRIES = 10  # a folder made and lost again this often: go on without the lock


@contextmanager
def reclaiming(root: Path, wait_s: float = WAIT_S) -> Iterator[bool]:
    """Hold ``root``'s lock exclusively; yields whether it is held."""
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        yield False  # vanished (a run's clean-up removed it empty) or unreadable
        return
    try:
        yield _lock(fd, fcntl.LOCK_EX, root, wait_s)
    finally:
        os.close(fd)  # drops the lock


@contextmanager
def making(folder: Path, wait_s: float = WAIT_S) -> Iterator[None]:
    """Make ``folder`` (``<root>/<run>/rank<r>/<kind>``, with its parents) and hold the root's
    lock shared until the block ends: create and hold the swap files inside the block. A
    folder elsewhere (not under a swap root: no reclaimer looks there) is only made."""
    parents = folder.parents
    root = parents[2] if len(parents) > 2 and parents[2].name == SWAP_ROOT else None
    for _ in range(RETRIES if root is not None else 0):
        try:
            folder.mkdir(parents=True, exist_ok=True)  # tolerates concurrent creation
            fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue  # a parent removed meanwhile (a reclaimer, a run's clean-up): again
        held = _lock(fd, fcntl.LOCK_SH, root, wait_s)
        # Locked, the root is the one on disk and still holds the folder (so it is not empty
        # and no clean-up removes it): no reclaimer can take the folder until the block ends.
        if not held or (_same(fd, root) and folder.is_dir()):
            try:
                yield
            finally:
                os.close(fd)
            return
        os.close(fd)  # a reclaimer took the folder (or the root went) before the lock: again
    folder.mkdir(parents=True, exist_ok=True)
    yield  # not under a swap root, or lost the folder RETRIES times: no lock


def _same(fd: int, root: Path) -> bool:
    try:
        on_disk, own = os.stat(root), os.fstat(fd)
    except OSError:
        return False
    return (on_disk.st_dev, on_disk.st_ino) == (own.st_dev, own.st_ino)


def _lock(fd: int, how: int, root: Path, wait_s: float) -> bool:
    """``flock(fd, how)``, waiting up to ``wait_s``; whether it is held."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
            return True
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False  # no flock on this filesystem
        if time.monotonic() >= deadline:
            log.warning(
                "%s: another process has held the swap folders' lock for %.0f s; going on "
                "without it",
                root,
                wait_s,
            )
            return False
        time.sleep(0.01)
