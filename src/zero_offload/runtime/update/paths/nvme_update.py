"""Placement "nvme": the host kernel over the same chunks as "host", each read from the rank's
swap file into a pool buffer ahead of its turn and written back behind it
(``nvme/optimizer_state.py``).

The NVMe step is every group and every rank, or nothing: ``stage`` writes this step's update
without committing or publishing it (no collective here, so a rank that fails does not leave
others waiting); then, once the ranks agree (``group_step.py``), ``commit`` on every group, or
``rollback`` on every group.
"""

from __future__ import annotations

from .host_update import HostUpdate


class NvmeUpdate(HostUpdate):
    stage_writes = True  # a failed write fails the step: the ranks agree before any commit
    _reuses_chunk_buffers = True  # the record pool: the next read reuses a chunk's buffer

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self._pending_commit = False  # an update is written and waits for commit or discard

    def prepare_update(self) -> None:
        """The step's backward began: read the first records of the state ahead, so the disk
        works while the backward computes (the update starts from records in memory)."""
        self.state.read_ahead()

    def stage(self, factor: float, delayed: bool = False) -> None:
        """This step's update written, not committed, not published (the config refuses the
        delayed update on NVMe)."""
        assert not delayed, "the delayed update runs on the host placement only"
        self.check_intact()
        self.flush()
        self.home.prepare_write()
        self.step_count += 1
        self._pending_commit = True
        try:
            self._host_pass(
                self.grads.host_grad(), factor, self._hyper(), upload=True, commit=False
            )
        finally:
            if self.streams.cuda:  # the uploads already queued land before anything else
                self.streams.h2d.synchronize()

    def commit(self) -> None:
        self.state.commit()
        self._pending_commit = False
        self.home.publish()

    def rollback(self) -> None:
        """The staged update forgotten, then the params restored from the committed master
        (the staged pass may have written some of its chunks to them)."""
        self.discard()
        self.restore_params()

    def discard(self) -> None:
        """Forget a staged update (none staged: nothing to do): the state and the step count are
        the last committed step's. The params may still hold some of its chunks."""
        if self._pending_commit:
            self.state.discard()
            self.step_count -= 1
            self._pending_commit = False
