"""A run's swap file is still the file it created: not removed, not cut short, not replaced by
another file under its name. Checked before the I/O of a step or a fetch depends on it; each
failure is an :class:`NvmeSwapError` naming the file.

Every swap file also holds a shared ``flock`` while this run has it open (released by the
kernel when the process dies), so ``reclaim.py`` can tell a dead run's folder from a live one
even across pid namespaces."""

from __future__ import annotations

import fcntl
import os

from ..errors import NvmeSwapError
from .aio import SwapFile

RESTART = "keep nvme_path free of cleaners and other writers, and restart from the last checkpoint"


def hold(file: SwapFile) -> None:
    """Mark ``file`` as in use by this process (until it is closed)."""
    fcntl.flock(file.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)


def check_swap_file(file: SwapFile, what: str) -> None:
    """Raise if ``file`` was removed, truncated or replaced since it was created."""
    try:
        own = os.fstat(file.fd)
    except OSError as e:
        raise NvmeSwapError(f"{file.path}: {what} swap file unusable: {e}") from None
    if own.st_nlink == 0:
        raise NvmeSwapError(
            f"{file.path}: the {what} swap file was removed while the run used it (deleted, or replaced by another file); {RESTART}"
        )
    if own.st_size < file.nbytes:
        raise NvmeSwapError(
            f"{file.path}: the {what} swap file was truncated to {own.st_size} bytes while the "
            f"run used it ({file.nbytes} written); {RESTART}"
        )
    try:
        named = os.stat(file.path)
    except OSError:
        named = None
    if named is None or (named.st_ino, named.st_dev) != (own.st_ino, own.st_dev):
        raise NvmeSwapError(
            f"{file.path}: the {what} swap file was renamed, or replaced by another file, "
            f"while the run used it; {RESTART}"
        )
