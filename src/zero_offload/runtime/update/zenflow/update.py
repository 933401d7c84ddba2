"""One group's ZenFlow step, on the step protocol: every ``step()`` of the engine is one
micro-step of DeepSpeed's ZenFlow (the engine's window is one backward), and this update runs
both parts of it: the device part (AdamW over the selected columns, every micro-step) and the
host part (the host Adam over the whole shard from the gradients accumulated since the last
host update, every ``update_interval`` micro-steps or at a selection).

Per micro-step ``k`` (DeepSpeed 0.19.8's order, fixed ``update_interval`` U):

- at a selection (``schedule.is_select(k)``): the master becomes the params (not at k = 0), the
  device moments are zeroed, and the columns are chosen from this micro-step's gradient;
- the host accumulator adds this micro-step's gradient divided by U (DeepSpeed sets
  gradient_accumulation_steps to U and scales the loss by 1/U; a bf16 gradient's sum is
  rounded to bf16, as DeepSpeed accumulates it; "auto": not divided, and
  ``auto`` decides which micro-steps are host updates, ``auto_interval.py``);
- not a host update: the device part updates the selected columns with that gradient;
- a host update: the selected columns' values are kept aside, the host Adam runs over the
  whole shard with the accumulated gradient (its norm clipped as ``gradient_clipping`` says,
  bias correction at step k + 1) and writes every param, the kept columns are put back, then the
  device part updates them.

Invariant: the selected columns (and the 1-D params) are the device part's alone; the host
update's result for them is discarded, and the master holds their values again at the next
selection. The device part's gradient is not clipped (as DeepSpeed); with fp16 it is unscaled
(DeepSpeed's is not, docs/zenflow.md).

Several ranks (stages 1 and 2, as DeepSpeed's): each rank's host part updates its own shard,
clipped by the norm of the whole accumulated gradient (its squares summed over the ranks); the
device part is the same on every rank (every rank updates every selected column, from the
selected columns' gradient all-reduced from the ranks' shard pieces, ``step_grads.py``; the
whole gradient never travels). Columns are ranked per DeepSpeed partition fragment
(``columns.py``) on the column norms all-reduced the same way, and rank 0's choice is
broadcast, so the ranks' columns never differ.

Stage 3 (as DeepSpeed's): params are not materialized. Columns are candidates by DeepSpeed's
per-param stage-3 partition and ranked together across it (``columns.py``); the device part
updates, on each rank, the selected elements its param shard holds, from its own grad shard
(``values.py``: no gradient travels), and the param home then drops its stale gathered copies.
A 2-D param of one row is updated whole, as a 1-D param (DeepSpeed treats it so).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator

import torch

from ....config.zero.zenflow import ZenFlowSchedule
from ....core import dist
from ....kernels.sumsq import sum_of_squares
from ..buffers import OffloadStateType, StateBuffer
from ..paths.host_update import HostUpdate
from .auto_interval import AutoInterval
from .columns import (
    column_fragments,
    select_from_sums,
    select_global,
    selected_count,
    stage3_candidates,
)
from .device_adam import ColumnState, adamw_values
from .step_grads import RankGrads, ShardGrads
from .values import ParamValues, ShardValues
from .wiring import shape_of

log = logging.getLogger("zero_offload")


class ZenFlowUpdate(HostUpdate):
    def __init__(
        self,
        *args,
        schedule: ZenFlowSchedule,
        clip: float,
        loss_scale: Callable[[], float],
        auto: AutoInterval | None = None,
        **kw,
    ) -> None:
        super().__init__(*args, **kw)
        self.schedule, self.clip, self.loss_scale = schedule, clip, loss_scale
        self.auto = auto  # update_interval "auto": the engine's one rule (auto_interval.py)
        self.micro = 0  # micro-steps taken (DeepSpeed's micro_step + 1)
        # The host accumulator: the gradients of the micro-steps since the last host update.
        self.accum = torch.zeros(self.span.numel, dtype=torch.float32)
        layout = self.group.layout
        self.ranges = [(o, o + n) for o, n in zip(layout.offsets, layout.numels)]
        self.columns: list[ColumnState] = [ColumnState(None) for _ in self.group.params]
        self.world = dist.world_size() if self.sharded else 1
        self.stage3 = self.group.flat is None  # params live in the param store's shards
        self.shapes = [shape_of(p) for p in self.group.params]
        # the params the device part updates whole (columns None), and the others' candidates
        self.whole = [len(s) != 2 or (self.stage3 and s[0] == 1) for s in self.shapes]
        if self.stage3:
            self.fragments = [[] if w else stage3_candidates(s, self.world)
                              for s, w in zip(self.shapes, self.whole)]  # fmt: skip
        else:  # DeepSpeed's fragments are laid out in registration order: flat order reversed
            frags = column_fragments(list(reversed(self.shapes)), self.world)
            self.fragments = list(reversed(frags))
        # the pieces of each param this rank's shard holds
        self.pieces = [list(self._owned(i)) for i in range(len(self.shapes))]
        self.step_grads = self._step_grads()
        self.values = self._values()

    def _step_grads(self) -> ShardGrads | RankGrads:
        """How this micro-step's gradient reaches the parts (``step_grads.py``)."""
        shapes = [torch.Size(s) for s in self.shapes]
        if self.world == 1:
            return ShardGrads(self.ranges, shapes)
        counts = [selected_count(f, self.schedule.topk_ratio) for f in self.fragments]
        dt = self.grads.host_grad().dtype
        # stage 3: the device part reads its own shard; only the column norms are reduced
        dev = self.group.device
        return RankGrads(self.pieces, shapes, counts, dt, dev, parts=not self.stage3)

    def _values(self) -> ParamValues | ShardValues:
        """Where the device part reads and writes (``values.py``)."""
        if not self.stage3:
            return ParamValues(self.group.params)
        g = self.group
        return ShardValues(self.home, self.pieces, self.shapes, self.whole, g.device, g.dtype,
                           self.streams)  # fmt: skip

    def _parts(self, grads: ShardGrads | RankGrads, shard: torch.Tensor) -> list[torch.Tensor]:
        """The device part's gradient: every rank's alike (stages 1-2), or the rank's own
        held elements (stage 3)."""
        if self.stage3:
            return self.values.parts(shard)
        return grads.parts([c.columns for c in self.columns])

    def step(self, factor: float) -> None:
        """Micro-step ``self.micro``'s update; ``factor`` (the engine's unscale x clip of this
        micro-step alone) is not used: the host part clips the accumulated gradient."""
        k, sched = self.micro, self.schedule
        shard = self.grads.host_grad()
        grads = self.step_grads
        grads.bind(shard)
        if sched.is_select(k):
            if k != 0:
                self.master_from_params()
            self._select(grads)
        host = sched.is_update(k) if self.auto is None else self.auto.begin(k)
        u = sched.grad_divisor
        self.accum.add_(shard, alpha=1.0 / u)  # promoted in the kernel: no fp32 copy
        if shard.dtype == torch.bfloat16:
            # DeepSpeed accumulates the interval's bf16 gradients in bf16 (its default
            # gradient_accumulation_dtype): each sum rounded to it. fp16 stays fp32: a sum of
            # loss-scaled fp16 gradients may overflow where each one did not.
            self.accum.copy_(self.accum.to(shard.dtype))
        device_part = k >= sched.full_warm_up_rounds
        parts = None
        if device_part:  # the selected columns' (and 1-D params') gradient
            parts = self._parts(grads, shard)
        if self.auto is not None and device_part:
            self._observe(grads, parts)
        # fp16: unscaled (DeepSpeed's is not, and the square of a loss-scaled gradient
        # overflows its fp16 moments); the loss scale is 1 otherwise.
        dev_scale = 1.0 / (u * float(self.loss_scale()))
        if not host:
            self._device_part(parts, dev_scale)
        elif not device_part:  # the warm-up: every element is the host's
            self._host_part(k + 1)
        else:
            kept = [self.values.read(i, c) for i, c in enumerate(self.columns)]
            # stage 3: the device part's own publish follows (one drop of the stale gathered
            # copies and one gather of the persistent params per step, not two)
            self._host_part(k + 1, publish=not self.stage3)
            self._device_part(parts, dev_scale, kept)
        self.micro += 1

    def _observe(self, grads: ShardGrads | RankGrads, parts: list[torch.Tensor]) -> None:
        """The "auto" rule's sums of this micro-step, per 2-D param, in the param's dtype."""
        dtypes = [self.group.dtype] * len(self.shapes)
        totals = grads.abs_sums(dtypes)
        if self.stage3:  # the ranks' held selected elements: their sums added
            critic = self.values.critic_sums(parts, dtypes)
        for i in range(len(self.shapes)):
            if self.whole[i]:
                continue
            key = (self.group.index, i)
            if self.stage3:
                self.auto.observe_sums(key, totals[i], critic[i])
            else:
                self.auto.observe(key, totals[i], parts[i].to(dtypes[i]))

    def _select(self, grads: ShardGrads | RankGrads) -> None:
        ratio = self.schedule.topk_ratio
        sums = grads.column_sums()
        pick = select_global if self.stage3 else select_from_sums
        for i, c in enumerate(self.columns):
            if not self.whole[i]:
                c.columns = pick(self._ranked(sums[i]), ratio, self.fragments[i]).to(
                    self.group.device
                )
            c.clear()
        if self.world > 1:
            self._agree_on_columns()
        if self.stage3:
            for i, c in enumerate(self.columns):
                if not self.whole[i]:
                    self.values.select(i, c.columns)

    def _ranked(self, sums: torch.Tensor) -> torch.Tensor:
        """The column norms as DeepSpeed ranks them: at stage 3 in its sum buffer's dtype, the
        params' (a bf16 norm rounds, and ties fall to the lower column, as in its top-k)."""
        return sums.to(self.group.dtype) if self.stage3 else sums

    def _agree_on_columns(self) -> None:
        """Every rank takes rank 0's columns: they are computed from the same gathered
        gradient, and the broadcast makes sure no rank's differ."""
        picked = [c.columns for c in self.columns if c.columns is not None]
        if not picked:
            return
        flat = torch.cat(picked).to(self.group.device)
        dist.broadcast(flat, src=0)
        at = 0
        for c in self.columns:
            if c.columns is not None:
                n = c.columns.numel()
                c.columns = flat[at : at + n].to(c.columns.device).clone()
                at += n

    def _device_part(
        self, parts: list[torch.Tensor], scale: float, kept: list[torch.Tensor] | None = None
    ) -> None:
        """AdamW over the selected columns and the 1-D params, from ``parts`` (their gradient;
        on one rank read from the host grad shard, so only these go up), starting from
        ``kept`` (their values before a host update wrote them) where given."""
        h, vals = self.group.hyper, self.values
        vals.begin()
        for i, (c, g) in enumerate(zip(self.columns, parts)):
            v = kept[i] if kept is not None else vals.read(i, c)
            vals.write(i, c, adamw_values(v, (g.float() * scale).to(v.device), c, h))
        vals.end()

    def _host_factor(self) -> float:
        """The accumulated gradient's unscale x clip, as DeepSpeed's step computes it."""
        scale = float(self.loss_scale())
        # one pass of the SIMD kernel (fp32 accumulation per thread): a float64 copy of the
        # whole shard was the largest cost of a host update on a CPU
        sumsq = float(sum_of_squares(self.accum))
        if self.world > 1:  # the whole accumulated gradient's norm: every rank's squares
            t = torch.tensor([sumsq], dtype=torch.float64, device=self.group.device)
            dist.all_reduce(t)
            sumsq = float(t[0])
        norm = math.sqrt(sumsq) / scale
        combined = scale
        if self.clip > 0:
            coef = (norm + 1e-6) / self.clip
            if coef > 1:
                combined = scale * coef
        return 1.0 / combined

    def _host_part(self, step: int, publish: bool = True) -> None:
        """The host Adam over the whole shard with the accumulated gradient, as DeepSpeed's
        step at its accumulation boundary: the norm's clip, bias correction at ``step``;
        ``publish`` False: the caller publishes the home after writing it again."""
        factor = self._host_factor()
        self.home.prepare_write()
        self.step_count = step
        self._host_pass(self.accum, factor, self._hyper(), upload=True)
        if publish:
            self.home.publish()
        self.accum.zero_()

    def nbytes(self) -> dict[str, int]:
        out = super().nbytes()
        out["host.zenflow_accum"] = self.accum.numel() * 4
        dev = 0
        for c in self.columns:
            for t in (c.exp_avg, c.exp_avg_sq, c.columns):
                dev += 0 if t is None else t.numel() * t.element_size()
        if self.stage3:  # the held elements' shard positions (and their device copy)
            out["host.zenflow_index"], on_device = self.values.nbytes()
            dev += on_device
        out["device.zenflow_columns"] = dev
        if self.world > 1:
            out["device.zenflow_grad"] = self.step_grads.nbytes()
            if self.step_grads.host_nbytes():  # where the pieces are assembled (stages 1-2)
                out["host.zenflow_staging"] = self.step_grads.host_nbytes()
        return out

    def device_buffers(self) -> Iterator[StateBuffer]:
        """The selected columns' moments and indices: optimizer state that ``offload_states``
        may move; on several ranks the gathered gradient too (scratch, with the gradients).
        Only the device part (this thread, inside ``step``) reads them; the overlapped host
        update never does, so moving them between steps is safe."""
        opt = OffloadStateType.optim_states
        for c in self.columns:
            for t in (c.exp_avg, c.exp_avg_sq, c.columns):
                if t is not None and t.device == self.group.device:
                    yield StateBuffer(t, "device.zenflow_columns", state=opt)
        if self.stage3:  # the held elements' positions beside a device param shard
            for t in self.values.device_index():
                yield StateBuffer(t, "device.zenflow_columns", state=opt)
        for t in self.step_grads.buffers():  # several ranks: rewritten by every step's reduce
            grads = OffloadStateType.lp_grads
            yield StateBuffer(t, "device.zenflow_grad", keep=False, state=grads)

    # ---- what a checkpoint keeps beyond the master and the host moments -----------------------
    def flush(self) -> None:
        """The master takes the device part's values of the selected columns (and the 1-D
        params), so that a checkpoint's master is the live params. Training is unchanged: the
        host update's result for them is discarded, and a selection resets them anyway."""
        super().flush()
        if self.micro == 0:
            return
        if self.stage3:
            if not self.aliased:  # the held elements' live values, at their shard positions
                for i, c in enumerate(self.columns):
                    ix = self.values.index[i]
                    self.master[ix] = self.values.read(i, c).to(self.master.dtype).cpu()
            return
        for i, (p, c) in enumerate(zip(self.group.params, self.columns)):
            if p.dim() != 1 and c.columns is None:
                continue
            live = p.detach().to(self.master.device, self.master.dtype)
            if p.dim() != 1:  # the master's own values, the selected columns' live ones
                mask = torch.zeros(p.shape, dtype=torch.bool, device=live.device)
                mask[:, c.columns.to(live.device)] = True
                live = torch.where(mask, live, self._master_param(i).view(p.shape))
            self._write_param_master(i, live.reshape(-1))

    def _owned(self, i: int) -> Iterator[tuple[int, int, int]]:
        """(param offset, shard offset, count) of each piece of param ``i`` in this shard."""
        lo, hi = self.ranges[i]
        for s in self.segs:
            a, b = max(lo, s.flat_start), min(hi, s.flat_start + s.numel)
            if a < b:
                yield a - lo, s.shard_start + a - s.flat_start, b - a

    def _master_param(self, i: int) -> torch.Tensor:
        """Param ``i`` (flat) as the master holds it (zero where another rank's)."""
        lo, hi = self.ranges[i]
        out = torch.zeros(hi - lo, dtype=self.master.dtype, device=self.master.device)
        for at, sh, n in self._owned(i):
            out[at : at + n] = self.master[sh : sh + n]
        return out

    def _write_param_master(self, i: int, flat: torch.Tensor) -> None:
        for at, sh, n in self._owned(i):
            self.master[sh : sh + n] = flat[at : at + n]

    def extra_state(self) -> dict[str, torch.Tensor]:
        """The mid-interval state: the micro-step count, the accumulated host gradient, and
        per param the selected columns, their device moments and step count."""
        out = {"zenflow.micro": torch.tensor([self.micro]), "zenflow.accum": self.accum}
        if self.auto is not None:
            out.update(self.auto.state(self.group.index, len(self.group.params)))
        for i, c in enumerate(self.columns):
            out[f"zenflow.{i}.step"] = torch.tensor([c.step])
            named = (("columns", c.columns), ("exp_avg", c.exp_avg), ("exp_avg_sq", c.exp_avg_sq))
            for name, t in named:
                if t is not None:
                    out[f"zenflow.{i}.{name}"] = t.detach().cpu().contiguous()
        return out

    def load_extra_state(self, fetch: Callable[[str], torch.Tensor | None]) -> None:
        """``extra_state`` back (``fetch(name)``: None when the checkpoint has no such tensor;
        ``restored``: whether it was). A checkpoint without ZenFlow's state, or with another shard
        size (saved on another number of ranks), starts it afresh on every rank alike: a
        selection at the next step."""
        micro, accum = fetch("zenflow.micro"), fetch("zenflow.accum")
        fits = micro is not None and accum is not None and accum.numel() == self.accum.numel()
        if self.world > 1:  # every rank restores, or none: their schedules stay one
            misfits = torch.tensor([0 if fits else 1], device=self.group.device)
            dist.all_reduce(misfits)
            fits = int(misfits[0]) == 0
        if micro is not None and not fits:
            log.warning(
                "zero_optimization.zenflow: the checkpoint's ZenFlow state was saved on another "
                "number of ranks; ZenFlow starts afresh (a selection at the next step)"
            )
        self.accum.zero_()
        self.columns = [ColumnState(None) for _ in self.group.params]
        self.micro = int(micro[0]) if fits else 0
        self.restored = fits
        if not fits:
            return
        self.accum.copy_(accum)
        if self.auto is not None:
            self.auto.load_state(self.group.index, len(self.group.params), fetch)
        for i, c in enumerate(self.columns):
            c.step = int(fetch(f"zenflow.{i}.step")[0])
            for name in ("columns", "exp_avg", "exp_avg_sq"):
                t = fetch(f"zenflow.{i}.{name}")
                if t is not None:
                    setattr(c, name, t.to(self.group.device))
            if self.stage3 and not self.whole[i] and c.columns is not None:
                self.values.select(i, c.columns)
