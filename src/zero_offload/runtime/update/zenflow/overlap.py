"""ZenFlow's ``overlap_step``: the host update of one interval runs on a worker thread during
the next interval's forward and backward, and lands in the params one interval later, as
DeepSpeed 0.19.8's overlapped optimizer process gives it when that process finishes each update
before anything else reads the master.

DeepSpeed's overlapped host Adam keeps two sets of moments and uses set ``(k // U) & 1`` for the
interval ending at micro-step k (during the warm-up: set ``k & 1``; with ``update_interval``
"auto": ``(k + 1) & 1``, its auto-update state, flipped at every backward); each update also
leaves a copy of the master (``stale``). At a host update after the warm-up, first the params
take the copy left by the previous update, then this interval's update starts on the master; the
first such update has no previous one, and without a warm-up the second one does not copy either
(DeepSpeed skips its first wait then). During the warm-up every update is copied at once. The
selected columns are the device part's as without overlap.

Ownership: while an update runs, the worker owns the master, both moment sets, ``stale`` and the
accumulator it was given; the step accumulates into the other accumulator. Everything that reads
the master first joins the worker (the next host update, a selection's copy of the params into
the master, ``flush``, a checkpoint), so the result never depends on timing (DeepSpeed's does:
its selection may overwrite the master under a running update).
"""

from __future__ import annotations

import concurrent.futures

import torch

from ....kernels.host_adam import host_adam_step
from ..paths.host_update import HostUpdate
from ..paths.host_worker import HostWorker
from ..shard_optimizer import TornStateError
from .update import KEY, ZenFlowRunner


class ZenFlowOverlapRunner(ZenFlowRunner):
    def __init__(self, *args, worker: HostWorker, **kw) -> None:
        """``worker``: the engine's one host-update worker (shared by its groups, joined by
        ``engine.destroy``)."""
        super().__init__(*args, **kw)
        self.worker = worker
        self._running: concurrent.futures.Future | None = None
        self._live: torch.Tensor | None = None

    def bind(self, u: HostUpdate) -> None:
        super().bind(u)
        n = u.span.numel
        # The second set of moments (the first is the shard state's) and the master's copy.
        self.exp_avg1 = torch.zeros(n, dtype=torch.float32)
        self.exp_avg_sq1 = torch.zeros(n, dtype=torch.float32)
        self.stale = torch.zeros(n, dtype=torch.float32)
        self.spare = torch.zeros(n, dtype=torch.float32)  # the accumulator not being filled
        self.updates_after_warmup = 0

    def join(self) -> None:
        """Wait for the running host update. Its failure leaves the master and moments partly
        updated by an update already counted: the state is torn (``TornStateError``)."""
        running, self._running = self._running, None
        if running is None:
            return
        try:
            running.result()
        except Exception as e:
            reason = (
                f"{KEY}.overlap_step: the overlapped host update of param group "
                f"{self.u.group.index} failed ({type(e).__name__}: {e})"
            )
            self.u.tear(reason)
            raise TornStateError(reason) from e

    def close(self) -> None:
        """The running update finished (its error, if any, is dropped with the engine)."""
        self._drop_running()

    def _drop_running(self) -> None:
        running, self._running = self._running, None
        if running is not None:
            concurrent.futures.wait([running])

    def _host_part(self, step: int, publish: bool = True) -> None:
        """``publish``: unused (the update lands one interval later, published by ``_copy``)."""
        k, sched = step - 1, self.schedule
        self.join()
        if k < sched.full_warm_up_rounds:
            self._submit(k & 1, step)
            self.join()
            self._copy()
            return
        self.updates_after_warmup += 1
        n = self.updates_after_warmup
        if n >= 2 and not (sched.full_warm_up_rounds == 0 and n == 2):
            self._copy()
        # "auto": DeepSpeed's auto-update state, flipped at every backward ((k + 1) & 1)
        which = (k + 1) & 1 if sched.auto_update else (k // sched.update_interval) & 1
        self._submit(which, step)

    def _submit(self, which: int, step: int) -> None:
        """Start this interval's host Adam on the master with moment set ``which`` (no param
        moves); the next steps accumulate into the spare accumulator meanwhile."""
        m, v = (
            (self.u.exp_avg, self.u.exp_avg_sq) if which == 0 else (self.exp_avg1, self.exp_avg_sq1)
        )
        h = dict(self.u._hyper(), adamw=self.u.adamw, grad_scale=self._host_factor(), step=step)
        h["bias_correction"] = bool(self.u.group.hyper.get("bias_correction", True))
        grad, self.accum, self.spare = self.accum, self.spare, self.accum
        self.u.step_count = step
        threads = self.worker.threads

        def update() -> None:
            host_adam_step(self.u.master, m, v, grad, None, threads=threads, **h)
            self.stale.copy_(self.u.master)
            grad.zero_()

        self._running = self.worker.submit(update)

    def nbytes(self) -> dict[str, int]:
        out = super().nbytes()
        out["host.zenflow_accum"] += self.spare.numel() * 4
        extra = (self.exp_avg1, self.exp_avg_sq1, self.stale)
        out["host.zenflow_overlap"] = sum(t.numel() * 4 for t in extra)
        return out

    def _copy(self) -> None:
        """The params take the master's copy left by the last update: cast into the staging
        and uploaded on the copy stream, as the host update's params are."""
        self.u.home.prepare_write()
        self.u.write_home(self.stale)
        self.u.home.publish()

    # ---- checkpoints: the second moments, the copy, and the params the copy has not reached --
    def _master_takes_live_values(self) -> None:
        """The running update finishes; the master is left as it is: with overlap its selected
        columns are not idle (a copy made before a selection reaches the columns that stop
        being selected)."""
        self.join()

    def extra_state(self) -> dict[str, torch.Tensor]:
        self.join()
        out = super().extra_state()
        out["zenflow.exp_avg1"], out["zenflow.exp_avg_sq1"] = self.exp_avg1, self.exp_avg_sq1
        out["zenflow.stale"] = self.stale
        out["zenflow.updates_after_warmup"] = torch.tensor([self.updates_after_warmup])
        # The master is one update ahead of the params: the live params are kept too.
        out["zenflow.params"] = torch.cat(
            [self.u.home.read(lo, hi).float() for lo, hi in self.u.chunks]
        )
        return out

    def check_extra_state(self, fetch, step_count: int, same_world: bool) -> None:
        super().check_extra_state(fetch, step_count, same_world)
        micro = fetch("zenflow.micro")
        accum = fetch("zenflow.accum")
        if micro is None or accum is None or accum.numel() != self.accum.numel():
            return  # afresh
        n = self.u.span.numel
        for name in ("exp_avg1", "exp_avg_sq1", "stale", "params"):
            t = fetch(f"zenflow.{name}")
            if t is None:
                raise ValueError(f"zenflow.{name} is missing (overlap_step keeps it)")
            if t.numel() != n:
                raise ValueError(f"zenflow.{name} has {t.numel()} elements, the shard {n}")
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"zenflow.{name} holds values that are not finite")
        after = fetch("zenflow.updates_after_warmup")
        if after is None or after.numel() != 1 or int(after.reshape(-1)[0]) < 0:
            raise ValueError("zenflow.updates_after_warmup must be one non-negative integer")
        if int(after.reshape(-1)[0]) > int(micro.reshape(-1)[0]):
            raise ValueError("zenflow.updates_after_warmup is more than zenflow.micro")

    def load_extra_state(self, fetch) -> None:
        self._drop_running()  # a failed update's error is moot: the load replaces what it wrote
        super().load_extra_state(fetch)
        self.spare.zero_()
        if not self.restored:  # afresh: nothing of the saved overlap state applies
            fetch = lambda name: None  # noqa: E731
        self._live = fetch("zenflow.params")
        n = fetch("zenflow.updates_after_warmup")
        self.updates_after_warmup = 0 if n is None else int(n[0])
        for name in ("exp_avg1", "exp_avg_sq1", "stale"):
            t = fetch(f"zenflow.{name}")
            getattr(self, name).copy_(t) if t is not None else getattr(self, name).zero_()

    def params_after_load(self) -> bool:
        """After a load: the params the checkpoint's run had (its master is ahead of them)."""
        live, self._live = self._live, None
        if live is None:
            return False
        self.u.home.prepare_write()
        for lo, hi in self.u.chunks:
            self.u.home.write(lo, live[lo:hi].to(self.u.group.dtype))
        self.u.home.publish()
        return True
