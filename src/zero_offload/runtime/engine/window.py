"""The accumulation window: which backward starts it, which one ends it (reduces), and whether a
``step()`` may follow; every rule about it is written here once.

A window starts at the first backward after a step was taken (``global_steps`` moved, whether the
step was applied or skipped) and ends at the backward that is a boundary: DeepSpeed's counter
(every ``gas``-th micro-step of the window), unless ``set_gradient_accumulation_boundary``
overrode it; inside ``no_sync`` no backward ends it. With ``managed`` false (DeepSpeed's
``managed_gradient_accumulation``) no backward ends it: ``step()`` does.

Invariant: the window's start is recovered lazily from the engine's counters (``global_steps``,
``micro_steps``), which the engine owns and a checkpoint load rewrites; the step code needs no
bookkeeping for it, and a load that moves the counters starts a new window.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import guards


@dataclass
class Window:
    gas: int  # gradient_accumulation_steps (set_train_batch_size changes it between windows)
    managed: bool = True  # False: every step() ends the window and updates
    boundary_override: bool | None = None  # set_gradient_accumulation_boundary
    inside_no_sync: bool = False
    start: int = 0  # micro_steps at the first backward of the current window
    start_steps: int = 0  # global_steps when ``start`` was last set
    touched_at: tuple[int, int] | None = None  # (global, micro) steps of the last backward
    in_step: bool = False  # unmanaged: a step() is running (the boundary)
    backwards: int = 0  # unmanaged: backwards since the last step()
    ended: bool = False  # a window-ending (reducing) backward ran in this micro-step
    ended_by_block: bool = False  # a coalesce_grad_reduction() block's exit ended it
    backward_since_step: bool = False
    ending: bool = False  # the running backward ends the window

    def _sync(self, global_steps: int, micro_steps: int) -> None:
        if global_steps != self.start_steps:
            self.start_steps, self.start = global_steps, micro_steps

    def is_boundary(self, global_steps: int, micro_steps: int) -> bool:
        """Does the current micro-batch end the window?"""
        if not self.managed:
            return self.in_step
        if self.boundary_override is not None:
            return self.boundary_override
        self._sync(global_steps, micro_steps)
        return (micro_steps - self.start + 1) % self.gas == 0

    def at_start(self, global_steps: int, micro_steps: int) -> bool:
        """Has nothing been accumulated in the window yet (no backward ran in it)?"""
        self._sync(global_steps, micro_steps)
        return micro_steps == self.start and self.touched_at != (global_steps, micro_steps)

    def reopens(self) -> bool:
        """Does this backward come after the one that ended the window, before ``step()`` (two
        losses, a loss per sub-batch)? It then reopens the window: its gradient is added to
        the window's reduced one, as torch's ``.grad`` accumulates, and it ends the window
        again (``GradShard.reopen``)."""
        return self.ended

    def begin_backward(self, global_steps: int, micro_steps: int) -> tuple[bool, bool]:
        """A backward begins: (does it start the window, does it end it). One that reopens the
        window must end it again (else its gradient would miss the step that follows), and a
        ``coalesce_grad_reduction`` block is one step of its own: both raise, changing nothing."""
        ending = not self.inside_no_sync and self.is_boundary(global_steps, micro_steps)
        if self.ended and self.ended_by_block:
            raise guards.backward_after_block_error()
        if self.ended and not ending:
            raise guards.reopen_without_end_error()
        first = self.at_start(global_steps, micro_steps)
        self.touched_at = (global_steps, micro_steps)
        self.backwards += 1
        self.ending = ending
        return first, self.ending

    def end_by_block(self) -> None:
        """A ``coalesce_grad_reduction`` block's exit ended the window."""
        self.ended = self.ended_by_block = True

    def end_backward(self) -> None:
        self.ended = self.ending
        self.backward_since_step = True

    def begin_step(self, global_steps: int) -> None:
        """``step()`` begins: not inside no_sync (checked first, as DeepSpeed does), and it
        needs a backward since the last one."""
        if self.inside_no_sync:
            raise guards.EngineAssertionError(
                "it is illegal to call engine.step() inside no_sync context manager"
            )
        if not self.backward_since_step:
            raise guards.step_without_backward_error(global_steps)
        self.ended = self.ended_by_block = self.backward_since_step = False

    def restart(self, global_steps: int, micro_steps: int) -> None:
        """A new window begins at the next backward (a failed NVMe step spent the micro-step)."""
        self.start, self.start_steps = micro_steps, global_steps
