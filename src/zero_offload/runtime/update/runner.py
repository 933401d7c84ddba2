"""The runner: how a group's update runs within the step protocol (``stage``, then ``commit`` or
``rollback``), one object chosen once when the update is built (``choose_runner``).

- ``Synchronous``: ``stage`` keeps the factor, ``commit`` runs the update inside the step; a
  rollback has nothing to undo.
- ``Delayed`` (offload_optimizer ``delayed_update``): from ``delayed_after`` on, ``commit``
  starts the host pass of step t on the engine's one worker and returns; the next commit (or
  ``flush``) joins it and uploads its params, so step t+1's forward and backward overlap it.
- ``Transactional`` (a state that declares ``transactional``: NVMe): ``stage`` writes the
  update without committing it (and may fail part way); once the ranks agree, ``commit`` makes
  it the state, or ``rollback`` discards it and restores the params from the committed master;
- ZenFlow's runners (``zenflow/update.py``, ``zenflow/overlap.py``): each micro-step's device
  part and, every interval, the host part, with the mid-interval state they keep (saved through
  the ``extra_state`` hooks below), synchronous or overlapped on the engine's worker.

Invariant: ``u.step_count`` counts committed updates; a runner raises before changing it or
puts it back.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol, cast

import torch

from .buffers import StateBuffer
from .paths.host_worker import HostWorker

Fetch = Callable[[str], "torch.Tensor | None"]

if TYPE_CHECKING:
    from .paths.host_update import HostUpdate
    from .shard_optimizer import ShardOptimizer


class Runner(Protocol):
    """What the update asks of its runner: the step protocol, and the runner's own state."""

    stage_writes: bool

    def bind(self, u: ShardOptimizer) -> None: ...
    def stage(self, u: ShardOptimizer, factor: float, delayed: bool) -> None: ...
    def commit(self, u: ShardOptimizer) -> None: ...
    def rollback(self, u: ShardOptimizer) -> None: ...
    def flush(self, u: ShardOptimizer) -> None: ...
    def prepare(self, u: ShardOptimizer) -> None: ...
    def close(self) -> None: ...
    def nbytes(self) -> dict[str, int]: ...
    def device_buffers(self) -> Iterator[StateBuffer]: ...
    def extra_state(self) -> dict[str, torch.Tensor]: ...
    def check_extra_state(self, fetch: Fetch, step_count: int, same_world: bool) -> None: ...
    def extra_digest(self, fetch: Fetch) -> torch.Tensor | None: ...
    def load_extra_state(self, fetch: Fetch) -> None: ...
    def params_after_load(self) -> bool: ...


class Synchronous:
    stage_writes = False  # the stage writes nothing: no agreement needed before commits

    def __init__(self) -> None:
        self._staged: float | None = None

    def stage(self, u: ShardOptimizer, factor: float, delayed: bool) -> None:
        if delayed:
            raise RuntimeError("the delayed update runs on the host placement only")
        self._staged = factor

    def commit(self, u: ShardOptimizer) -> None:
        factor, self._staged = self._staged, None
        if factor is not None:
            u.run(factor)

    def rollback(self, u: ShardOptimizer) -> None:
        self._staged = None

    def flush(self, u: ShardOptimizer) -> None:
        """Nothing runs behind the step."""

    def prepare(self, u: ShardOptimizer) -> None:
        """Nothing to start before the update."""

    def close(self) -> None:
        """Nothing held."""

    def bind(self, u: ShardOptimizer) -> None:
        """The update this runner runs (called once, when it is built); nothing to keep."""

    # State of the runner's own beyond the shard state (ZenFlow's): none here.
    def nbytes(self) -> dict[str, int]:
        return {}

    def device_buffers(self) -> Iterator[StateBuffer]:
        return iter(())

    def extra_state(self) -> dict[str, torch.Tensor]:
        return {}

    def check_extra_state(self, fetch: Fetch, step_count: int, same_world: bool) -> None:
        """Nothing saved, nothing to refuse."""

    def extra_digest(self, fetch: Fetch) -> torch.Tensor | None:
        return None

    def load_extra_state(self, fetch: Fetch) -> None:
        """Nothing saved."""

    def params_after_load(self) -> bool:
        """After a load the params are the master's cast (the update writes them)."""
        return False


class Delayed(Synchronous):
    def __init__(self, worker: HostWorker) -> None:
        super().__init__()
        self.worker = worker
        self._delayed = False
        self._pending: concurrent.futures.Future | None = None

    def stage(self, u: ShardOptimizer, factor: float, delayed: bool) -> None:
        self._staged, self._delayed = factor, delayed

    def commit(self, u: ShardOptimizer) -> None:
        factor, self._staged = self._staged, None
        if factor is None:
            return
        self.flush(u)
        if not self._delayed:
            u.run(factor)
            return
        host = cast("HostUpdate", u)  # the delayed runner is chosen for host updates only
        grad = host.grads.host_grad()
        host.grads.flip()  # the next backward copies into the other host buffer
        u.step_count += 1
        h = u._hyper()  # read here: the scheduler may change the lr before the worker runs
        self._pending = self.worker.submit(
            host.host_pass, grad, factor, h, False, True, self.worker.threads
        )

    def flush(self, u: ShardOptimizer) -> None:
        """Join a delayed host pass, if any, and upload + gather its params."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        pending.result()  # re-raises a failure of the host pass here, on the main thread
        u.home.prepare_write()
        cast("HostUpdate", u).send_all()
        u.home.publish()

    def close(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.exception()  # finished; its failure belongs to no step any more


class Transactional(Synchronous):
    stage_writes = True  # a failed write fails the step: the ranks agree before any commit

    def __init__(self) -> None:
        super().__init__()
        self._pending = False  # an update is written and waits for commit or discard

    def prepare(self, u: ShardOptimizer) -> None:
        """The step's backward began: read the first records of the state ahead, so the disk
        works while the backward computes."""
        u.state.read_ahead()

    def stage(self, u: ShardOptimizer, factor: float, delayed: bool) -> None:
        """The update written, not committed, not published (the config refuses the delayed
        update on NVMe)."""
        assert not delayed, "the delayed update runs on the host placement only"
        u.home.prepare_write()
        u.step_count += 1
        self._pending = True
        try:
            u.apply(factor, commit=False)
        finally:
            if u.streams.cuda:  # the uploads already queued land before anything else
                u.streams.h2d.synchronize()

    def commit(self, u: ShardOptimizer) -> None:
        if not self._pending:
            return
        u.state.commit()
        self._pending = False
        u.home.publish()

    def rollback(self, u: ShardOptimizer) -> None:
        """The staged update forgotten (the state and the step count are the last committed
        step's), then the params restored from the committed master (the staged pass may
        have written some of its chunks to them)."""
        if self._pending:
            u.state.discard()
            u.step_count -= 1
            self._pending = False
        u.restore_params()


def choose_runner(transactional: bool, worker: HostWorker | None) -> Synchronous:
    """``worker``: the engine's host worker when the delayed update is configured."""
    if transactional:
        return Transactional()
    return Delayed(worker) if worker is not None else Synchronous()
