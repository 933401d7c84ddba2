"""``update_interval`` "auto": DeepSpeed 0.19.8's run-time rule for when the host update runs.

Per 2-D param, at every micro-step after the warm-up (before the device part), with ``ui`` the
micro-steps of the current interval counted so far, ``r`` = ``topk_ratio``::

    avg_critic = (avg_critic * (ui - 1) + |selected gradient|_1) / ui / (r * 10)
    non_critic += (|gradient|_1 rounded to bf16 - |selected gradient|_1) / ((1 - r) * 10)

A param "needs an update" when ``non_critic >= avg_critic`` (compared as DeepSpeed's tensors
compare: in bf16); when at least ``int(auto_ratio * N)`` of the N 2-D params of the engine do
(one or more 2-D params having been seen), the NEXT micro-step ends an interval with a host
update, and at its start ``ui`` and every ``non_critic`` restart from 0 (``avg_critic`` goes
on). The warm-up steps and the select_interval multiples end an interval too, without a restart.
The loss is not divided (DeepSpeed sets gradient_accumulation_steps to 0 and divides by it,
which is NaN: docs/zenflow.md). The arithmetic is DeepSpeed's own tensor arithmetic, dtypes
included, so the decisions are its decisions.

One object serves every group of the engine (N counts them all); each group's step calls
``begin`` with its micro-step (the first call of a micro-step moves the rule on) and
``observe`` per 2-D param.
"""

from __future__ import annotations

from typing import Any

import torch

from ....config.zero.zenflow import ZenFlowSchedule


class AutoInterval:
    def __init__(self, schedule: ZenFlowSchedule, num_2d: int) -> None:
        self.schedule = schedule
        self.threshold = int(schedule.auto_ratio * num_2d)
        self.micro = -1  # the micro-step ``begin`` last moved to
        self.interval = 0  # DeepSpeed's optimizer.update_interval
        self.need = False  # this micro-step's decision: the next one ends an interval
        self.count = 0
        self.boundary = False
        self.non_critic: dict[Any, Any] = {}
        self.avg_critic: dict[Any, Any] = {}
        # this micro-step's per-param comparisons, counted in one device-to-host sync when the
        # decision is read (``_settle``), not one per param
        self._votes: list[torch.Tensor] = []

    def begin(self, micro: int) -> bool:
        """Whether micro-step ``micro`` (0-based) ends an interval with a host update."""
        if micro == self.micro:
            return self.boundary
        self._settle()
        self.micro = micro
        ends, self.need, self.count = self.need, False, 0
        if ends:
            self.interval = 0
            self.non_critic = dict.fromkeys(self.non_critic, 0)
        self.interval += 1
        si, warm = self.schedule.select_interval, self.schedule.full_warm_up_rounds
        self.boundary = micro + 1 <= warm or ends or (si != 0 and (micro + 1) % si == 0)
        return self.boundary

    @torch.no_grad()
    def observe(self, key: Any, total: torch.Tensor, selected: torch.Tensor) -> None:
        """One 2-D param's sum of |g| this micro-step (``g`` in the param's dtype) and its
        selected columns' part of ``g``."""
        # DeepSpeed's bf16 sum buffer, beside the selected part (one rank: summed on the host)
        total = total.to(selected.device, torch.bfloat16).reshape(1)
        self.observe_sums(key, total, selected.abs().sum())

    @torch.no_grad()
    def observe_sums(self, key: Any, total: torch.Tensor, critic: torch.Tensor) -> None:
        """``observe`` from the sums themselves: ``total`` as DeepSpeed keeps it (stage 3: in
        the params' dtype, summed over the ranks) and the selected part's ``critic``."""
        r, ui = self.schedule.topk_ratio, self.interval
        avg = self.avg_critic.get(key, 0)
        self.avg_critic[key] = (avg * (ui - 1) + critic) / ui / (r * 10)
        self.non_critic[key] = self.non_critic.get(key, 0) + (total - critic) / ((1 - r) * 10)
        vote = self.non_critic[key] >= self.avg_critic[key]
        self._votes.append(vote.reshape(-1).to(critic.device))

    def _settle(self) -> None:
        """Count this micro-step's params that need an update; enough of them (one or more
        having been seen) and the next micro-step ends the interval."""
        if not self._votes:
            return
        self.count += int(torch.cat(self._votes).sum())  # one sync for the micro-step
        self._votes = []
        if self.count >= self.threshold:
            self.need = True

    # ---- a staged micro-step: what ``begin`` and ``observe`` change, kept and put back ----
    def snapshot(self) -> tuple:
        """The rule as it is now (its sums are replaced, never changed in place, so shallow
        copies keep them)."""
        counters = (self.micro, self.interval, self.need, self.count, self.boundary)
        return counters, dict(self.non_critic), dict(self.avg_critic), list(self._votes)

    def restore(self, snap: tuple) -> None:
        counters, non, avg, votes = snap
        self.micro, self.interval, self.need, self.count, self.boundary = counters
        self.non_critic, self.avg_critic, self._votes = dict(non), dict(avg), list(votes)

    # ---- checkpoints: a group keeps the counters and its own params' sums, in their dtypes ---
    def state(self, group: int, num_params: int) -> dict[str, torch.Tensor]:
        self._settle()
        counters = [self.micro, self.interval, int(self.need), self.count, int(self.boundary)]
        out = {"zenflow.auto": torch.tensor(counters)}
        for i in range(num_params):
            for name, sums in (("avg", self.avg_critic), ("non", self.non_critic)):
                value = sums.get((group, i))
                if isinstance(value, torch.Tensor):
                    out[f"zenflow.auto.{i}.{name}"] = value.detach().clone()
                elif value is not None:  # DeepSpeed's integer 0 (a restart)
                    out[f"zenflow.auto.{i}.{name}.zero"] = torch.tensor([0])
        return out

    def load_state(self, group: int, num_params: int, fetch) -> None:
        counters = fetch("zenflow.auto")
        if counters is None:
            return
        self.micro, self.interval, need, self.count, boundary = (int(v) for v in counters)
        self.need, self.boundary = bool(need), bool(boundary)
        for i in range(num_params):
            for name, sums in (("avg", self.avg_critic), ("non", self.non_critic)):
                value = fetch(f"zenflow.auto.{i}.{name}")
                if value is None and fetch(f"zenflow.auto.{i}.{name}.zero") is not None:
                    value = 0
                if value is not None:
                    sums[(group, i)] = value
