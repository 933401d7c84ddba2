"""A checkpoint never preserves poisoned state as if it were good: the master weights and Adam
moments a save writes are checked to be finite as they are written (no extra pass over an NVMe
state), and a non-finite value stops the save with an error naming the params it belongs to.

Invariant: the check sees every element the rank file holds for a state kind, in shard order;
it raises before the save is published (``save.py`` makes every rank raise and discards the
staging folder), so ``latest`` and the previous checkpoints stay as they were.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator

import torch

from ..format import CheckpointError

WHAT = {"master": "fp32 master weights", "exp_avg": "Adam exp_avg", "exp_avg_sq": "Adam exp_avg_sq"}
SHOWN = 8  # params named in the error


def param_names_at(group, segs, shard_idx: torch.Tensor) -> list[str]:
    """The params (of ``group``, flat order) that shard indices ``shard_idx`` of a rank whose
    partition is ``segs`` belong to; padding is named as such."""
    layout = group.layout
    starts = [s.shard_start for s in segs]
    names: list[str] = []
    for i in shard_idx.tolist():
        seg = segs[bisect.bisect_right(starts, i) - 1]
        flat = seg.flat_start + (i - seg.shard_start)
        j = bisect.bisect_right(layout.offsets, flat) - 1
        inside = j >= 0 and flat < layout.offsets[j] + layout.numels[j]
        name = group.names[j] if inside else "(alignment padding)"
        if name not in names:
            names.append(name)
    return names


def _refuse(group, segs, kind: str, bad: torch.Tensor, gi: int) -> CheckpointError:
    names = param_names_at(group, segs, bad[: 64 * SHOWN])
    more = f" and more ({bad.numel()} non-finite elements)" if len(names) > SHOWN else ""
    return CheckpointError(
        f"save_checkpoint refused: the {WHAT[kind]} of {names[:SHOWN]}{more} (param group "
        f"{gi}) hold inf or NaN; a checkpoint must not preserve poisoned state as if it were "
        "good. Nothing was published: resume from the last checkpoint, and look for what made "
        "the state non-finite (an lr or loss scale out of range, a damaged swap file)"
    )


def checked(
    group, segs, kind: str, gi: int, pieces: Iterable[torch.Tensor]
) -> Iterator[torch.Tensor]:
    """``pieces`` (the state's consecutive chunks, from shard index 0), each passed on once it
    is known to be finite."""
    at = 0
    for t in pieces:
        finite = torch.isfinite(t)
        if not bool(finite.all()):
            raise _refuse(group, segs, kind, (~finite).nonzero().reshape(-1) + at, gi)
        at += t.numel()
        yield t


def check_tensor(group, segs, kind: str, gi: int, t: torch.Tensor) -> None:
    """A whole in-memory state kind is finite (see :func:`checked`)."""
    for _ in checked(group, segs, kind, gi, [t.reshape(-1)]):
        pass
