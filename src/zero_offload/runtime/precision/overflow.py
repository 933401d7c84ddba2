"""What the engine does about steps skipped for non-finite gradients.

Every skipped step is reported (rank 0, rate-limited to one line per ``interval`` seconds that
counts the skips it stands for). A run that cannot recover stops with :class:`OverflowStopError`
after ``limit`` consecutive skips that loss scaling can no longer fix: with fp16's dynamic scale
those skipped while the scale is already at ``min_loss_scale`` (DeepSpeed stops there too:
"Current loss scale already at minimum"); with a static scale, bf16 or fp32, every skipped step.
``limit`` 0 never stops. The decision is the same on every rank (the overflow flag is global),
so every rank raises at the same step.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("zero_offload")


class OverflowStopError(RuntimeError):
    """Training stopped: gradients stayed non-finite for too many consecutive steps."""


class OverflowMonitor:
    def __init__(
        self, dynamic: bool, min_scale: float, limit: int, rank: int, interval: float = 10.0
    ) -> None:
        self.dynamic, self.min_scale, self.limit = dynamic, min_scale, limit
        self.warn = rank == 0
        self.interval = interval
        self.consecutive = 0  # skips in a row that scaling cannot fix
        self._last_warn = -float("inf")
        self._unreported = 0

    def after_step(
        self,
        overflow: bool,
        scale_before: float,
        scale_after: float,
        step: int,
        cause: str | None = None,
    ) -> None:
        """Record one step's outcome (``step`` is the 1-based step just taken); ``cause``:
        what the gradients held (``overflow_cause``), for the report."""
        cause = cause or "gradients are not finite (inf/NaN)"
        if not overflow:
            self.consecutive = 0
            return
        stuck = not self.dynamic or scale_before <= self.min_scale
        self.consecutive = self.consecutive + 1 if stuck else 0
        self._unreported += 1
        now = time.monotonic()
        if self.warn and now - self._last_warn >= self.interval:
            more = (
                f" ({self._unreported} skipped since the last report)"
                if self._unreported > 1
                else ""
            )
            scale = f"; loss scale {scale_before:g} -> {scale_after:g}" if self.dynamic else ""
            log.warning("step %d skipped: %s%s%s", step, cause, scale, more)
            self._last_warn, self._unreported = now, 0
        if self.limit and self.consecutive >= self.limit:
            why = (
                f"with the loss scale already at its minimum ({self.min_scale:g}, "
                "fp16.min_loss_scale): Current loss scale already at minimum"
                if self.dynamic
                else "(no loss scale to lower: static scale, bf16 or fp32)"
            )
            raise OverflowStopError(
                f"stopping at step {step}: {self.consecutive} consecutive steps skipped for a "
                f"gradient norm that is not finite (last: {cause}) {why}. The model or data "
                "produces inf/NaN or gradients too large for float32; lower the learning rate, "
                "check the inputs, or raise max_consecutive_overflows (0: never stop)."
            )
