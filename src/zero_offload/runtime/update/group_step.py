"""One step over every optimizer group: stage each, agree once across ranks when a group's stage
writes (NVMe), then commit every group or roll every group back.

All or nothing: the master weights and moments never hold a partial step, and the ranks never
disagree on which step they hold. The agreement is one all-reduced flag, and only when some
group's ``stage`` can fail part way (``OptimizerGroup.stage_writes``); otherwise ``stage`` only
keeps the factor and ``commit`` runs the update, whose errors propagate as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ...core import dist
from ...nvme.errors import NvmeSwapError
from .group import OptimizerGroup


def step_groups(
    groups: Sequence[OptimizerGroup],
    factor: float,
    step: int,
    world_size: int,
    device: torch.device,
    on_rollback: Callable[[], None],
) -> None:
    """Global step ``step``'s update on every group. A failed stage (here or on another rank)
    rolls every group back, calls ``on_rollback`` (the window's gradients are spent) and raises
    ``NvmeSwapError``."""
    error = None
    for g in groups:
        try:
            g.stage(factor, step)
        except Exception as e:
            error = e
            break
    failed = 0 if error is None else 1
    if world_size > 1 and any(g.stage_writes for g in groups):
        flag = torch.tensor([failed], dtype=torch.int32, device=device)
        dist.all_reduce(flag)  # one rank's failure is every rank's
        failed = int(flag.item())
    if not failed:
        for g in groups:
            g.commit()
        return
    restore = _rollback_all(groups)
    on_rollback()
    raise _failure(error, failed, step, restore)


def _rollback_all(groups: Sequence[OptimizerGroup]) -> Exception | None:
    """Every group rolled back, on every rank, with no collective; the first error of a restore
    (the disk may still be failing: restore what can be) is returned, not raised."""
    first = None
    for g in groups:
        try:
            g.rollback()
        except Exception as e:
            first = first or e
    return first


def _failure(
    error: Exception | None, failed: int, step: int, restore: Exception | None
) -> Exception:
    if error is not None and not isinstance(error, NvmeSwapError):
        wrapped = NvmeSwapError(
            f"the NVMe update failed ({type(error).__name__}: {error}); every rank kept the "
            "last committed step"
        )
        wrapped.__cause__ = error
        error = wrapped
    if error is None:
        error = NvmeSwapError(
            f"the NVMe update failed on {failed} other rank(s) at step {step + 1} (their error "
            "names the file); every rank kept the last committed step"
        )
    if restore is not None:
        error.add_note(f"restoring the params from the committed master failed too: {restore}")
    return error
