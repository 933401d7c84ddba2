"""One step over every optimizer group: stage each, agree once across ranks when a group's stage
writes (NVMe, ZenFlow), then commit every group or roll every group back.

All or nothing: the master weights and moments never hold a partial step, and the ranks never
disagree on which step they hold. The agreement is one all-reduced flag, and only when some
group's ``stage`` can fail part way (``OptimizerGroup.stage_writes``); otherwise ``stage`` only
keeps the factor and ``commit`` runs the update.

A failed stage rolls every group back (in reverse order: a later group's stage saw what an
earlier one changed) and raises ``StepRolledBackError`` (``NvmeSwapError`` for a swap file's).
A commit that fails leaves some groups at the new step and others not: every group is then
marked torn (``ShardOptimizer.tear``) and refuses to step or save until a checkpoint is loaded,
so a partial step is never trained on or saved as if it were whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ...core import dist
from ...nvme.errors import NvmeSwapError
from .group import OptimizerGroup
from .shard_optimizer import TornStateError


class StepRolledBackError(RuntimeError):
    """A step's update failed before any group committed: every group on every rank kept the
    last committed step, and the step's gradients are spent (run the step's batch again)."""


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
    ``StepRolledBackError`` or ``NvmeSwapError``; a failed commit tears every group and raises
    ``TornStateError``."""
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
        _commit_all(groups, step)
        return
    restore = _rollback_all(groups)
    on_rollback()
    if isinstance(error, TornStateError):  # torn before this step: nothing to roll back to
        for g in groups:
            g.optimizer.tear(error.reason)
        raise error
    nvme = any(g.placement.nvme is not None for g in groups)
    raise _failure(error, failed, step, restore, nvme)


def _commit_all(groups: Sequence[OptimizerGroup], step: int) -> None:
    for i, g in enumerate(groups):
        try:
            g.commit()
        except Exception as e:
            reason = (
                f"the update of step {step + 1} failed in param group {g.index} after "
                f"{i} of {len(groups)} group(s) had committed it ({type(e).__name__}: {e})"
            )
            for other in groups:
                other.optimizer.tear(reason)
            raise TornStateError(reason) from e


def _rollback_all(groups: Sequence[OptimizerGroup]) -> Exception | None:
    """Every group rolled back, last first, on every rank, with no collective; the first error of
    a restore (the disk may still be failing: restore what can be) is returned, not raised (a
    state the disk no longer holds is refused by its own checks at the next read or save)."""
    first = None
    for g in reversed(groups):
        try:
            g.rollback()
        except Exception as e:
            first = first or e
    return first


class _NvmeRolledBack(NvmeSwapError, StepRolledBackError):
    """Another rank's swap file failed the step: rolled back here too."""


def _failure(
    error: Exception | None, failed: int, step: int, restore: Exception | None, nvme: bool
) -> Exception:
    if isinstance(error, OSError):  # a swap file's I/O: the NVMe error the engine names
        wrapped: Exception = NvmeSwapError(
            f"the NVMe update failed ({type(error).__name__}: {error}); every rank kept the "
            "last committed step"
        )
        wrapped.__cause__ = error
        error = wrapped
    elif error is not None and not isinstance(error, NvmeSwapError):
        wrapped = StepRolledBackError(
            f"the update of step {step + 1} failed ({type(error).__name__}: {error}); every "
            "param group on every rank kept the last committed step"
        )
        wrapped.__cause__ = error
        error = wrapped
    if error is None:  # an NVMe run names it so: the other rank's error names the file
        cls = _NvmeRolledBack if nvme else StepRolledBackError
        error = cls(
            f"the update of step {step + 1} failed on {failed} other rank(s) (their error "
            "says why); every param group on every rank kept the last committed step"
        )
    if restore is not None:
        error.add_note(f"restoring the params from the committed master failed too: {restore}")
    return error
