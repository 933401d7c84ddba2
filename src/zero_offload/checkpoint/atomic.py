"""Publishing a checkpoint so that a crash at any instant leaves the previous one whole.

Sequence (rank 0 does the renames; every rank writes its own files):

1. write everything into ``<save_dir>/.<tag>.partial/`` and fsync each file;
2. fsync that directory, then rename it to ``<save_dir>/<tag>``. When ``<tag>`` already exists it
   is first renamed aside to ``.<tag>.replaced`` and removed only after the new one is in place;
   a reader that finds ``<tag>`` missing but ``.<tag>.replaced`` present uses the latter, so the
   tag stays loadable through the swap;
3. fsync ``<save_dir>``, then replace ``latest`` atomically (write ``.latest.tmp``, fsync,
   rename, fsync the directory).

Until step 2's rename the new data is invisible; until step 3 ``latest`` names the old tag.

``ZERO_OFFLOAD_CHECKPOINT_PAUSE=<point>`` makes a save stop at that point (see ``pause``) so that
crash tests can kill it there; it is read at each point, never cached.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

from .format import LATEST_FILE, CheckpointNotFoundError
from .scripts.meta_checks import latest_tag

PAUSE_ENV = "ZERO_OFFLOAD_CHECKPOINT_PAUSE"
PAUSE_POINTS = ("after_shards", "before_publish", "replaced", "before_latest")


def pause(point: str) -> None:
    """Fault-injection hook: when ``$ZERO_OFFLOAD_CHECKPOINT_PAUSE`` names ``point``, announce it
    on stderr and sleep (a test kills the process there); no effect otherwise."""
    if os.environ.get(PAUSE_ENV) == point:
        sys.stderr.write(f"zero_offload checkpoint paused at {point}\n")
        sys.stderr.flush()
        time.sleep(3600)


def staging_dir(root: Path, tag: str) -> Path:
    return root / f".{tag}.partial"


def replaced_dir(root: Path, tag: str) -> Path:
    return root / f".{tag}.replaced"


def fsync_dir(path: Path) -> None:
    """Make renames and new entries in ``path`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems (and Windows) refuse fsync on a directory
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def prepare_staging(root: Path, tag: str) -> Path:
    """An empty staging directory; a leftover from a crashed save of the same tag is discarded."""
    root.mkdir(parents=True, exist_ok=True)
    stage = staging_dir(root, tag)
    if stage.exists():
        shutil.rmtree(stage)
    stage.mkdir()
    fsync_dir(root)
    return stage


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` in one rename: readers see the old or the new file, whole."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def publish(root: Path, tag: str) -> Path:
    """Rename the staged directory to ``tag`` (replacing an existing one safely)."""
    stage, final, aside = staging_dir(root, tag), root / tag, replaced_dir(root, tag)
    fsync_dir(stage)
    if final.exists():
        if aside.exists():  # left by an earlier crash after the swap: ``final`` is the whole copy
            shutil.rmtree(aside)
        os.rename(final, aside)
        fsync_dir(root)
        pause("replaced")
    # else: if ``aside`` exists it is the only whole copy of ``tag``; it stays until the new one
    # is in place.
    os.rename(stage, final)
    fsync_dir(root)
    if aside.exists():
        shutil.rmtree(aside)
    return final


def write_latest(root: Path, tag: str) -> None:
    write_bytes_atomic(root / LATEST_FILE, tag.encode("utf-8"))


def read_latest(root: Path) -> str | None:
    """The tag ``latest`` names, or None when there is no ``latest`` file."""
    path = root / LATEST_FILE
    if not path.exists():
        return None
    tag = latest_tag(path)
    return tag


def resolve(root: Path, tag: str) -> Path:
    """The directory holding ``tag``: the tag itself, or the copy set aside by an interrupted
    replacement of it."""
    final = root / tag
    if final.is_dir():
        return final
    aside = replaced_dir(root, tag)
    if aside.is_dir():
        return aside
    raise CheckpointNotFoundError(f"checkpoint tag {tag!r} not found: {final} does not exist")
