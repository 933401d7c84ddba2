"""The start-up agreement over ``nvme_path``: one rank per node prepares each path, the node's
other ranks on it check it once that is done, and if any rank fails every rank raises.

Preparing a path (``preflight.check_nvme_path`` with ``prepare=True``) creates it when missing
and reclaims the swap folders of this host's dead runs there. Its preparer is the lowest rank
whose path has the same identity: this host's name, the path with symlinks resolved, and the
device and inode of its nearest existing folder (so containers sharing a host name but not the
mount each prepare their own). The other ranks on that path wait at the first agreement (an
``all_reduce`` every rank joins) and check it afterwards without preparing, so within one job
no two ranks reclaim or create one folder at once. Two jobs on one drive, or ranks whose
identities differ for one folder, may still prepare it at the same moment; ``preflight.py``
and ``reclaim.py`` tolerate that (defence in depth), they only do the work twice.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config.errors import ConfigError
from ..core import dist
from .preflight import check_nvme_path


@dataclass(frozen=True)
class PathNeed:
    """One ``nvme_path`` this rank will put swap files under."""

    key: str  # the config key it came from (named by every error)
    path: Path  # the nvme_path as configured
    nbytes: int  # free bytes it must have (the node's share, as the caller counts it)


def check_nvme_paths(
    needs: list[PathNeed], device: torch.device, error: Exception | None = None
) -> list[Path]:
    """Prepare and check every rank's ``needs`` (see the module's rules); a collective: every
    rank calls it, with its own needs (none is fine). ``error``: this rank already failed
    before (it still takes part, and every rank raises). Returns the paths this rank prepared.
    """
    mine = _prepares(needs)
    if error is None:
        error = _attempt([n for n, p in zip(needs, mine) if p], prepare=True)
    agree(error, device)  # the preparers are done: the others may look
    agree(_attempt([n for n, p in zip(needs, mine) if not p], prepare=False), device)
    return [n.path for n, p in zip(needs, mine) if p]


def agree(error: Exception | None, device: torch.device) -> None:
    """Raise ``error`` on its rank and a ``ConfigError`` on every other one if any rank failed;
    return on every rank otherwise. A collective when there are several ranks."""
    if dist.world_size() > 1:
        failed = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=device)
        dist.all_reduce(failed)
        if error is None and int(failed.item()):
            raise ConfigError(
                f"NVMe offload set-up failed on {int(failed.item())} other rank(s) (their error "
                "names the key and path); nothing was partitioned or written"
            )
    if error is not None:
        raise error


def _attempt(needs: list[PathNeed], prepare: bool) -> Exception | None:
    try:
        for n in needs:
            check_nvme_path(n.key, n.path, n.nbytes, prepare=prepare)
    except Exception as e:  # any failure: this rank must still take part in the agreement
        return e
    return None


def _prepares(needs: list[PathNeed]) -> list[bool]:
    """Whether this rank prepares each of its paths: it is the lowest rank with that path's
    identity. A collective when there are several ranks."""
    ids = [_identity(n.path) for n in needs]
    every: list[list[tuple] | None] = [None] * dist.world_size()
    dist.all_gather_object(every, ids)
    me = dist.rank()
    first = {}
    for rank, theirs in enumerate(every):
        for i in theirs or ():
            first.setdefault(i, rank)
    return [first[i] == me for i in ids]


def _identity(path: Path) -> tuple:
    """(host, resolved path, device and inode of its nearest existing folder); never raises
    (a bad path is ``check_nvme_path``'s to name)."""
    resolved = os.path.realpath(path)
    probe = resolved
    while True:
        try:
            st = os.stat(probe)
            return socket.gethostname(), resolved, st.st_dev, st.st_ino
        except (OSError, ValueError):
            parent = os.path.dirname(probe)
            if parent == probe:
                return socket.gethostname(), resolved, None, None
            probe = parent
