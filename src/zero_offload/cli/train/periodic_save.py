"""The train command's periodic checkpoints: a failed save (a full disk, a permission error) is
reported with the path and the run goes on from the last good checkpoint instead of dying with a
traceback; ``--keep-last N`` removes older checkpoints after each good save.

Invariants: a checkpoint is only removed after a newer one has been published (``latest``
names it), and only tags this command writes (``global_step<N>``) are ever removed.
"""

from __future__ import annotations

import os
import re
import shutil
import sys

_TAG = re.compile(r"global_step(\d+)")


class PeriodicSaver:
    def __init__(self, engine, save_dir: str, every: int, keep_last: int = 0) -> None:
        self.engine, self.save_dir, self.every, self.keep_last = engine, save_dir, every, keep_last
        self.failures = 0
        self.last_good: str | None = None

    def maybe_save(self, step: int, gas: int) -> None:
        """Save at every ``every``-th step (a collective: every rank calls it)."""
        from zero_offload.checkpoint import CheckpointError

        if not self.every or step % self.every:
            return
        tag = f"global_step{self.engine.global_steps}"
        try:
            self.engine.save_checkpoint(
                self.save_dir, tag=tag, client_state={"step": step, "micro_batches": step * gas}
            )
        except CheckpointError as err:  # every rank raises it together (the save agrees first)
            self.failures += 1
            if self.engine.global_rank == 0:
                kept = self.last_good or "none written by this run"
                print(
                    f"zero-offload train: warning: checkpoint at step {step} not saved: {err}\n"
                    f"  the last good checkpoint is kept: {kept}; training continues",
                    file=sys.stderr,
                )
            return
        self.last_good = os.path.join(self.save_dir, tag)
        if self.keep_last and self.engine.global_rank == 0:
            self._prune(keep=tag)

    def _prune(self, keep: str) -> None:
        tags = []
        for name in os.listdir(self.save_dir):
            m = _TAG.fullmatch(name)
            if m and os.path.isdir(os.path.join(self.save_dir, name)):
                tags.append((int(m.group(1)), name))
        old = [name for _, name in sorted(tags)[: -self.keep_last] if name != keep]
        for name in old:
            shutil.rmtree(os.path.join(self.save_dir, name), ignore_errors=True)
