"""ZenFlow's ``overlap_step``: the host update of one interval lands in the params one interval
later, as DeepSpeed 0.19.8's overlapped optimizer process gives it when that process finishes
each update before the next interval ends (a host update here runs synchronously, so the result
is the same whatever the timing).

DeepSpeed's overlapped host Adam keeps two sets of moments and uses set ``(k // U) & 1`` for the
interval ending at micro-step k (during the warm-up: set ``k & 1``); each update also leaves a
copy of the master (``stale``). At a host update after the warm-up, first the params take the
copy left by the previous update, then this interval's update runs on the master; the first such
update has no previous one, and without a warm-up the second one does not copy either (DeepSpeed
skips its first wait then). During the warm-up every update is copied at once. The selected
columns are the device part's as without overlap.
"""

from __future__ import annotations

import torch

from ...kernels.host_adam import host_adam_step
from ..update.host_update import HostUpdate
from .update import ZenFlowUpdate


class ZenFlowOverlapUpdate(ZenFlowUpdate):
    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        n = self.span.numel
        # The second set of moments (the first is the shard state's) and the master's copy.
        self.exp_avg1 = torch.zeros(n, dtype=torch.float32)
        self.exp_avg_sq1 = torch.zeros(n, dtype=torch.float32)
        self.stale = torch.zeros(n, dtype=torch.float32)
        self.updates_after_warmup = 0

    def _host_part(self, step: int) -> None:
        k, sched = step - 1, self.schedule
        warm = k < sched.full_warm_up_rounds
        if warm:
            self._submit(k & 1, step)
            self._copy()
            return
        self.updates_after_warmup += 1
        n = self.updates_after_warmup
        if n >= 2 and not (sched.full_warm_up_rounds == 0 and n == 2):
            self._copy()
        self._submit((k // sched.update_interval) & 1, step)

    def _submit(self, which: int, step: int) -> None:
        """This interval's host Adam on the master with moment set ``which``; no param moves."""
        m, v = (self.exp_avg, self.exp_avg_sq) if which == 0 else (self.exp_avg1, self.exp_avg_sq1)
        h = self._hyper()
        bc = bool(self.group.hyper.get("bias_correction", True))
        factor = self._host_factor()
        host_adam_step(
            self.master,
            m,
            v,
            self.accum,
            None,
            step=step,
            adamw=self.adamw,
            bias_correction=bc,
            grad_scale=factor,
            threads=self.threads,
            **h,
        )
        self.step_count = step
        self.stale.copy_(self.master)
        self.accum.zero_()

    def _copy(self) -> None:
        """The params take the master's copy left by the last update."""
        self.home.prepare_write()
        for lo, hi in self.chunks:
            self.home.write(lo, self.stale[lo:hi].to(self.group.dtype))
        self.home.publish()

    # ---- checkpoints: the second moments, the copy, and the params the copy has not reached --
    def flush(self) -> None:
        """The master is left as it is: with overlap its selected columns are not idle (a copy
        made before a selection reaches the columns that stop being selected)."""
        HostUpdate.flush(self)

    def extra_state(self) -> dict[str, torch.Tensor]:
        out = super().extra_state()
        out["zenflow.exp_avg1"], out["zenflow.exp_avg_sq1"] = self.exp_avg1, self.exp_avg_sq1
        out["zenflow.stale"] = self.stale
        out["zenflow.updates_after_warmup"] = torch.tensor([self.updates_after_warmup])
        # The master is one update ahead of the params: the live params are kept too.
        out["zenflow.params"] = torch.cat(
            [self.home.read(lo, hi).float() for lo, hi in self.chunks]
        )
        return out

    def load_extra_state(self, fetch) -> None:
        super().load_extra_state(fetch)
        self._live = fetch("zenflow.params")
        n = fetch("zenflow.updates_after_warmup")
        self.updates_after_warmup = 0 if n is None else int(n[0])
        for name in ("exp_avg1", "exp_avg_sq1", "stale"):
            t = fetch(f"zenflow.{name}")
            getattr(self, name).copy_(t) if t is not None else getattr(self, name).zero_()

    def params_from_master(self) -> None:
        """After a load: the params the checkpoint's run had (its master is ahead of them)."""
        live, self._live = getattr(self, "_live", None), None
        if live is None:
            super().params_from_master()
            return
        self.home.prepare_write()
        for lo, hi in self.chunks:
            self.home.write(lo, live[lo:hi].to(self.group.dtype))
        self.home.publish()
