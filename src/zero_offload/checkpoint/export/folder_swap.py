"""Replacing a whole folder so that a reader (or a kill) at any instant sees the old folder or
the new one, whole: the new one is built in a sibling folder, then the two are exchanged.

Invariants:
- ``swap_into_place(new, final)``: on return ``final`` holds what ``new`` held and ``new`` is
  gone. On Linux the exchange is one ``renameat2(RENAME_EXCHANGE)``: ``final`` never stops
  existing. Elsewhere ``final`` is renamed aside to ``aside_dir(final)`` first, and
  ``recover(final)`` (run before the next replacement) moves a whole aside copy back when a
  kill came between the two renames;
- ``carry_over(old, new, skip)`` links (or copies) into ``new`` every entry of ``old`` that
  ``new`` lacks and ``skip`` does not name, so files the caller does not own (a tokenizer next
  to exported weights) survive the swap. ``old`` is not changed.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from ..atomic import fsync_dir

AT_FDCWD = -100
RENAME_EXCHANGE = 2


def sibling(final: Path, what: str) -> Path:
    """``<parent>/.<name>.<what>``: next to ``final``, on its filesystem (renames stay cheap)."""
    final = final.resolve()
    return final.parent / f".{final.name}.{what}"


def aside_dir(final: Path) -> Path:
    return sibling(final, "replaced")


def recover(final: Path) -> None:
    """Undo a swap a kill interrupted between its two renames (non-Linux path only)."""
    aside = aside_dir(final)
    if aside.is_dir() and not final.exists():
        os.rename(aside, final)
        fsync_dir(final.resolve().parent)
    elif aside.is_dir():
        shutil.rmtree(aside)  # the new folder was in place: the aside copy is stale


def swap_into_place(new: Path, final: Path) -> None:
    """Make ``new`` the folder ``final`` (see the module's invariants); the old contents are
    removed once the new ones are in place."""
    fsync_dir(new)
    parent = final.resolve().parent
    if not final.exists():
        os.rename(new, final)
    elif _exchange(new, final):
        fsync_dir(parent)
        shutil.rmtree(new, ignore_errors=True)  # ``new`` now holds the old contents
    else:
        aside = aside_dir(final)
        os.rename(final, aside)
        os.rename(new, final)
        fsync_dir(parent)
        shutil.rmtree(aside, ignore_errors=True)
    fsync_dir(parent)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically exchange two paths; False where the system cannot (then nothing changed)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    rc = renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):  # no such call or flag here
        return False
    raise OSError(err, os.strerror(err), str(b))


def carry_over(old: Path, new: Path, skip: Callable[[str], bool]) -> list[str]:
    """Link or copy ``old``'s entries missing from ``new`` (but those ``skip`` names) into it;
    their names."""
    carried = []
    if not old.is_dir():
        return carried
    for entry in sorted(old.iterdir()):
        target = new / entry.name
        if skip(entry.name) or target.exists() or target.is_symlink():
            continue
        if entry.is_symlink():
            os.symlink(os.readlink(entry), target)
        elif entry.is_dir():
            shutil.copytree(entry, target, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(entry, target)
        carried.append(entry.name)
    return carried


def _link_or_copy(src, dst) -> None:
    try:
        os.link(src, dst)  # the same bytes, no copy: the old folder is removed right after
    except OSError:
        shutil.copy2(src, dst)
