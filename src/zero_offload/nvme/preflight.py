"""Checks of an ``nvme_path`` before the first step, so that a bad path is a config error naming
its key at start-up, not an I/O error in the middle of a step."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from ..config.errors import ConfigError, json_repr
from .reclaim import Reclaimed, kept_runs, reclaim_dead_runs

GIB = 1 << 30
log = logging.getLogger("zero_offload")


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB"


def check_nvme_path(
    key: str, path: str | os.PathLike[str], need_bytes: int, prepare: bool = True
) -> Path:
    """``path`` resolved to an absolute path, once checked to be usable for swap files.

    ``prepare``: this caller creates the path when missing and reclaims dead runs' folders
    there (the first and third points below). Several processes may prepare one path at once
    and none fails because of another's work; at start-up one rank per node prepares each path
    and the others check it afterwards with ``prepare=False`` (``path_agreement.py``).

    Invariants on return (at the time of the call):

    - ``path`` is a directory (symlinks followed), created with its parents when missing
      (``prepare``; a directory another process creates meanwhile is as good);
    - this process can create and remove a file in it (a uniquely named probe file, so ranks
      checking one directory at once do not collide; it is removed before returning);
    - the swap folders of dead runs of this host under it were removed first
      (``reclaim.py``; ``prepare``), with one log line saying how much was reclaimed;
    - its filesystem has at least ``need_bytes`` bytes free (``shutil.disk_usage``). Only this
      caller's need is checked: callers sharing a filesystem each check their own share, and
      space taken after the check is not reserved. The error names the swap folders left
      there (other hosts' runs, live runs, folders that could not be removed).

    ``key`` is the config key the path came from (``zero_optimization.offload_optimizer.nvme_path``);
    every failure raises :class:`~zero_offload.config.errors.ConfigError` naming it and the path,
    and for space, the bytes needed and available in GiB. ``need_bytes`` must be >= 0.
    """
    if isinstance(need_bytes, bool) or not isinstance(need_bytes, int) or need_bytes < 0:
        raise ValueError(f"check_nvme_path: need_bytes must be an int >= 0, got {need_bytes!r}")
    given = os.fspath(path)
    where = f"{key}: {json_repr(given)}"
    fix = f"{key.rsplit('.', 1)[-1]} must be a writable local directory"
    if not given:
        raise ConfigError(f"{key}: empty path; {fix}")
    resolved = _resolve(given, where, fix)
    if prepare:
        _ensure_dir(resolved, key, where, fix)
    if not _is_dir(resolved, where, fix):
        what = "is not a directory" if os.path.lexists(resolved) else "does not exist"
        raise ConfigError(f"{where} {what}; {fix}")
    _probe_writable(resolved, where, fix)
    reclaimed = reclaim_dead_runs(resolved) if prepare else None
    free = shutil.disk_usage(resolved).free
    if free < need_bytes:
        if reclaimed is None:  # what the preparing rank kept is still there: name it
            reclaimed = kept_runs(resolved)
        raise ConfigError(
            f"{where} has {_gib(free)} free, {_gib(need_bytes)} needed ({need_bytes} bytes) for "
            "this rank's swap files; free space there or point the key at a larger local drive"
            + _leftovers(reclaimed)
        )
    return resolved


def _resolve(given: str, where: str, fix: str) -> Path:
    """``given`` resolved (symlinks followed as far as they exist)."""
    try:
        return Path(given).resolve()
    except OSError as exc:  # e.g. a parent directory this process may not search
        raise ConfigError(f"{where} cannot be inspected ({exc.strerror or exc}); {fix}") from None
    except RuntimeError:  # pathlib's "Symlink loop from ..." (Python < 3.13)
        raise ConfigError(
            f"{where} is a symlink loop (it never reaches a directory); {fix}"
        ) from None


def _is_dir(path: Path, where: str, fix: str) -> bool:
    try:
        return path.is_dir()
    except OSError as exc:  # e.g. a parent directory this process may not search
        raise ConfigError(f"{where} cannot be inspected ({exc.strerror or exc}); {fix}") from None


def _probe_writable(path: Path, where: str, fix: str) -> None:
    """Create and remove a uniquely named file in ``path`` (ranks probing at once never meet)."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".zero_offload_probe_", dir=path)
    except OSError as exc:
        raise ConfigError(
            f"{where} is not writable (could not create a file in it: {exc.strerror or exc}); {fix}"
        ) from None
    try:
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError(
            f"{where}: could not remove the probe file {json_repr(probe)} "
            f"({exc.strerror or exc}); {fix}"
        ) from None


def _ensure_dir(path: Path, key: str, where: str, fix: str) -> None:
    """A missing ``nvme_path`` is created with its parents (DeepSpeed's swappers create theirs).
    One that another process creates at the same moment is a directory like any other: only a
    non-directory already there is an error (raised by the caller's ``is_dir`` check)."""
    if _is_dir(path, where, fix):
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)  # tolerates concurrent creation
        try:
            path.mkdir()
        except FileExistsError:
            return  # made meanwhile (another rank or job), or not a directory: the caller says
    except OSError as exc:
        raise ConfigError(
            f"{where} does not exist and could not be created ({exc.strerror or exc}); {fix}"
        ) from None
    log.info("%s: created the folder %s", key, path)


def _leftovers(reclaimed: Reclaimed) -> str:
    if not reclaimed.left:
        return ""
    shown = [f"{p} ({_gib(n)}, {why})" for p, n, why in reclaimed.left[:8]]
    more = f" and {len(reclaimed.left) - 8} more" if len(reclaimed.left) > 8 else ""
    return (
        f"; swap folders of other runs are there and were kept: {', '.join(shown)}{more} "
        "(remove those whose runs have ended)"
    )
