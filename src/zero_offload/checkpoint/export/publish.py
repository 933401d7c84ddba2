"""How a staged export becomes ``out_dir`` (``sharded.ShardWriter.publish``).

- **swap** (the rule): the export was staged in a sibling folder; the entries of ``out_dir``
  that are not an earlier export's weights are hard-linked into it, then the two folders are
  exchanged in one rename (``folder_swap.py``). A kill at any instant leaves the previous
  export whole in ``out_dir``, or the new one.
- **in place** (the exception): used when ``out_dir`` cannot be swapped safely, i.e. it holds
  folders or links (a Trainer's output folder with checkpoints and logs that other code may
  write into while the export runs), is a mount point, or holds this process's working
  directory. The export was staged inside ``out_dir``; an old index is removed first, the
  files are renamed in, the index last, so a kill leaves the previous export, or a folder with
  no index (nothing that looks complete).

Either way an earlier export's shards that the new one does not overwrite are removed, as
``save_pretrained`` removes them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

from .. import atomic
from . import folder_swap

PAUSE_BEFORE_SWAP = "export_before_swap"  # ZERO_OFFLOAD_CHECKPOINT_PAUSE points (crash tests)
PAUSE_BEFORE_INDEX = "export_before_index"
INSIDE = ".zero_offload_export.partial"  # the staging folder inside ``out_dir`` (in place)
SIBLING = "zero_offload_export.partial"  # the sibling staging folder: .<out>.<SIBLING> (swap)

Naming = Callable[[Path, str], AbstractContextManager]


def swappable(out: Path) -> bool:
    """Whether ``out`` (existing or not) can be replaced by a folder swap (see the module)."""
    if not out.exists():
        return True
    resolved = out.resolve()
    cwd = Path.cwd().resolve()
    if os.path.ismount(resolved) or resolved == cwd or resolved in cwd.parents:
        return False
    return all(p.is_file() and not p.is_symlink() for p in out.iterdir() if p.name != INSIDE)


def staging_folder(out: Path, swap: bool) -> Path:
    return folder_swap.sibling(out, SIBLING) if swap else out / INSIDE


def publish_swap(stage: Path, out: Path, is_weights: Callable[[str], bool], naming: Naming):
    with naming(out, "carry the folder's other files over"):
        folder_swap.carry_over(out, stage, lambda name: name == INSIDE or is_weights(name))
    atomic.pause(PAUSE_BEFORE_SWAP)
    with naming(out, "replace"):
        folder_swap.swap_into_place(stage, out)


def publish_in_place(
    stage: Path, out: Path, names: list[str], idx: str, single: str | None, naming: Naming
) -> None:
    """``names``: the weight files; ``single``: the one-file name an index would be shadowed by
    (None when the export is one file); every other staged file is moved in first."""
    atomic.fsync_dir(stage)
    with naming(out / idx, "replace"):
        if (out / idx).exists():  # the previous shard set stops looking complete first
            os.remove(out / idx)
            atomic.fsync_dir(out)
    first = sorted(p.name for p in stage.iterdir() if p.name not in names and p.name != idx)
    for name in [*first, *names]:
        with naming(out / name, "replace"):
            os.replace(stage / name, out / name)
    if single is not None:
        with naming(out / single, "replace"):
            if (out / single).is_file():  # would shadow the index on load
                os.remove(out / single)
        atomic.fsync_dir(out)
        atomic.pause(PAUSE_BEFORE_INDEX)
        with naming(out / idx, "replace"):
            os.replace(stage / idx, out / idx)
    atomic.fsync_dir(out)


def remove_stale_shards(out: Path, pattern: re.Pattern, keep: set[str]) -> None:
    for p in out.iterdir():  # shards of an earlier export that this one did not overwrite
        if pattern.fullmatch(p.name) and p.name not in keep and p.is_file():
            p.unlink()
    atomic.fsync_dir(out)
