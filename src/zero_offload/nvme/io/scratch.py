"""Swap files are scratch: each is removed with the object that owns it (or at exit), and so
are the run folders above it once empty. Nothing a resume reads ever lives in them."""

from __future__ import annotations

import weakref

from .aio import SwapFile

# <nvme_path>/zero_offload_swap/<run>/rank<r>/<optimizer|param>/<file>: the four folders above a
# swap file that belong to this library.
OWN_FOLDERS = 4


def discard(file: SwapFile) -> None:
    """Close and delete ``file``, then its own folders once empty (never anything else)."""
    file.unlink()
    for folder in list(file.path.parents)[:OWN_FOLDERS]:
        try:
            folder.rmdir()
        except OSError:
            break  # not empty: another group's, rank's or run's files are still there


def own_file(owner: object, file: SwapFile) -> weakref.finalize:
    """``file`` is discarded when ``owner`` is collected, at exit, or when the returned
    finalizer is called (idempotent)."""
    return weakref.finalize(owner, discard, file)
