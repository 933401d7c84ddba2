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
from dataclasses import dataclass

import torch

from ....config.zero.zenflow import ZenFlowSchedule
from ....core import dist
from ....core.partitioned import shape_of
from ....kernels.sumsq import sum_of_squares
from ..buffers import OffloadStateType, StateBuffer
from ..paths.host_update import HostUpdate
from .auto_interval import AutoInterval
from .columns import (
    column_fragments,
    num_selected,
    select_from_sums,
    select_global,
    selected_count,
    stage3_candidates,
)
from .device_adam import ColumnState, adamw_step
from .step_grads import RankGrads, ShardGrads
from .values import ParamValues, ShardValues, transfer_all

log = logging.getLogger("zero_offload")
KEY = "zero_optimization.zenflow"
Fetch = Callable[[str], "torch.Tensor | None"]


def _count(t: torch.Tensor, name: str) -> int:
    """A saved counter: one non-negative integer."""
    if t.numel() != 1 or t.dtype.is_floating_point or int(t.reshape(-1)[0]) < 0:
        raise ValueError(f"{name} must be one non-negative integer, not {t.tolist()}")
    return int(t.reshape(-1)[0])


def _finite(t: torch.Tensor, name: str) -> None:
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} holds values that are not finite")


@dataclass
class _Undo:
    """What a staged micro-step changed before its commit, to put back on a rollback."""

    auto: tuple | None  # the "auto" rule before the micro-step
    index: list[torch.Tensor] | None = None  # stage 3: the positions before a selection
    values: tuple | None = None  # (columns, values) the device part's write replaced


@dataclass
class _Staged:
    """A staged micro-step: what ``commit`` applies."""

    k: int
    select: bool
    host: bool
    columns: list[ColumnState]  # the columns and device moments after the micro-step
    scale: float  # the loss scale its gradient carries
    shard: torch.Tensor  # its gradient (the host grad shard)
    values: list[torch.Tensor] | None = None  # the device part's new values
    written: bool = False  # ``values`` are in the params already (written by ``stage``)
    undo: _Undo | None = None


class ZenFlowRunner:
    """ZenFlow's runner of a host update ``u`` (bound once, ``bind``): it owns the step
    protocol of the group, the mid-interval state, and both parts' arithmetic; the host part
    runs through ``u``'s host pass, staging and home."""

    def __init__(
        self,
        schedule: ZenFlowSchedule,
        clip: float,
        loss_scale: Callable[[], float],
        auto: AutoInterval | None = None,
    ) -> None:
        self.schedule, self.clip, self.loss_scale = schedule, clip, loss_scale
        self.auto = auto  # update_interval "auto": the engine's one rule (auto_interval.py)

    def bind(self, u: HostUpdate) -> None:
        """The update this runner runs (once, when the update is built)."""
        self.u = u
        self.micro = 0  # micro-steps taken (DeepSpeed's micro_step + 1)
        # The host accumulator: the gradients of the micro-steps since the last host update.
        self.accum = torch.zeros(self.u.span.numel, dtype=torch.float32)
        layout = self.u.group.layout
        self.ranges = [(o, o + n) for o, n in zip(layout.offsets, layout.numels)]
        self.columns: list[ColumnState] = [ColumnState(None) for _ in self.u.group.params]
        self.world = dist.world_size() if self.u.sharded else 1
        self.stage3 = self.u.group.flat is None  # params live in the param store's shards
        self.shapes = [shape_of(p) for p in self.u.group.params]
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
        self._held: _Staged | None = None
        self._flushed = False  # the master holds the live values since the last commit

    def _step_grads(self) -> ShardGrads | RankGrads:
        """How this micro-step's gradient reaches the parts (``step_grads.py``)."""
        shapes = [torch.Size(s) for s in self.shapes]
        if self.world == 1:
            return ShardGrads(self.ranges, shapes)
        counts = [selected_count(f, self.schedule.topk_ratio) for f in self.fragments]
        dt = self.u.grads.host_grad().dtype
        # stage 3: the device part reads its own shard; only the column norms are reduced
        dev = self.u.group.device
        return RankGrads(self.pieces, shapes, counts, dt, dev, parts=not self.stage3)

    def _values(self) -> ParamValues | ShardValues:
        """Where the device part reads and writes (``values.py``)."""
        if not self.stage3:
            return ParamValues(self.u.group.params)
        g = self.u.group
        return ShardValues(self.u.home, self.pieces, self.shapes, self.whole, g.device, g.dtype,
                           self.u.streams)  # fmt: skip

    def _parts(
        self, grads: ShardGrads | RankGrads, shard: torch.Tensor, columns: list[ColumnState]
    ) -> list[torch.Tensor]:
        """The device part's gradient: every rank's alike (stages 1-2), or the rank's own
        held elements (stage 3)."""
        if self.stage3:
            return self.values.parts(shard)
        return grads.parts([c.columns for c in columns])

    def _observe(self, grads: ShardGrads | RankGrads, parts: list[torch.Tensor]) -> None:
        """The "auto" rule's sums of this micro-step, per 2-D param, in the param's dtype."""
        dtypes = [self.u.group.dtype] * len(self.shapes)
        totals = grads.abs_sums(dtypes)
        if self.stage3:  # the ranks' held selected elements: their sums added
            critic = self.values.critic_sums(parts, dtypes)
        for i in range(len(self.shapes)):
            if self.whole[i]:
                continue
            key = (self.u.group.index, i)
            if self.stage3:
                self.auto.observe_sums(key, totals[i], critic[i])
            else:
                self.auto.observe(key, totals[i], parts[i].to(dtypes[i]))

    def counts(self) -> list[int]:
        """Per param how many columns a selection picks (0: updated whole)."""
        ratio = self.schedule.topk_ratio
        if self.stage3:
            return [0 if w else num_selected(sum(b - a for a, b in f), ratio)
                    for f, w in zip(self.fragments, self.whole)]  # fmt: skip
        return [0 if w else selected_count(f, ratio) for f, w in zip(self.fragments, self.whole)]

    def _select(self, grads: ShardGrads | RankGrads, undo: _Undo) -> list[ColumnState]:
        """The new columns (their moments from zero), the same on every rank: rank 0's. A
        rank whose choice fails still takes part in the broadcast (its columns -1), so the
        ranks fail together instead of waiting on each other."""
        ratio, dev = self.schedule.topk_ratio, self.u.group.device
        sums = grads.column_sums()
        pick = select_global if self.stage3 else select_from_sums
        error, chosen = None, []
        for i, n in enumerate(self.counts()):
            if self.whole[i]:
                chosen.append(None)
                continue
            try:
                cols = pick(self._ranked(sums[i]), ratio, self.fragments[i]).to(dev)
            except Exception as e:
                error = error or e
                cols = torch.full((n,), -1, dtype=torch.int64, device=dev)
            chosen.append(cols)
        if self.world > 1:
            chosen = self._agree_on_columns(chosen)
        if error is not None:
            raise error
        if any(c is not None and bool((c < 0).any()) for c in chosen):
            raise RuntimeError(f"{KEY}: the column selection failed on rank 0")
        if self.stage3:
            undo.index = self.values.swap(
                [
                    self.values.index_of(i, None if w else c)
                    for i, (c, w) in enumerate(zip(chosen, self.whole))
                ]  # fmt: skip
            )
        return [c.reselected(cols) for c, cols in zip(self.columns, chosen)]

    def _ranked(self, sums: torch.Tensor) -> torch.Tensor:
        """The column norms as DeepSpeed ranks them: at stage 3 in its sum buffer's dtype, the
        params' (a bf16 norm rounds, and ties fall to the lower column, as in its top-k)."""
        return sums.to(self.u.group.dtype) if self.stage3 else sums

    def _agree_on_columns(self, chosen: list) -> list:
        """Every rank takes rank 0's columns: they are computed from the same gathered
        gradient, and the broadcast makes sure no rank's differ."""
        picked = [c for c in chosen if c is not None]
        if not picked:
            return chosen
        flat = torch.cat(picked).to(self.u.group.device)
        dist.broadcast(flat, src=0)
        out, at = [], 0
        for c in chosen:
            if c is None:
                out.append(None)
                continue
            n = c.numel()
            out.append(flat[at : at + n].to(c.device).clone())
            at += n
        return out

    # ---- the step protocol: stage does what can fail, commit what cannot --------------------
    # The device part, the selection, the collectives and the reads of a swap file run in
    # ``stage``; a failure there rolls back every group (``group_step.py``). What ``stage``
    # wrote (the device part of a micro-step that is neither a host update nor a selection)
    # it can undo: the values it replaced are kept until ``commit`` or ``rollback``. ``commit``
    # adds the gradient to the accumulator, runs the host part and writes what ``stage``
    # computed; it reads no file except through an NVMe param home.
    stage_writes = True

    def stage(self, u: HostUpdate, factor: float, delayed: bool = False) -> None:
        """Micro-step ``self.micro``, staged; ``factor`` (the engine's unscale x clip of this
        micro-step alone) is not used: the host part clips the accumulated gradient."""
        if delayed:
            raise RuntimeError("ZenFlow has no delayed update (the config refuses it)")
        self.u.check_intact()
        undo = _Undo(self.auto.snapshot() if self.auto is not None else None)
        try:
            self._held = self._stage(undo)
        except BaseException:
            self._undo(undo)
            raise

    def _stage(self, undo: _Undo) -> _Staged:
        k, sched = self.micro, self.schedule
        shard = self.u.grads.host_grad()
        grads = self.step_grads
        grads.bind(shard)
        select = sched.is_select(k)
        host = sched.is_update(k) if self.auto is None else self.auto.begin(k)
        columns = self._select(grads, undo) if select else self.columns
        device_part = k >= sched.full_warm_up_rounds
        parts = self._parts(grads, shard, columns) if device_part else None
        if self.auto is not None and device_part:
            self._observe(grads, parts)
        # fp16: the micro-step's own loss scale (it may change within an interval)
        scale = float(self.loss_scale())
        staged = _Staged(k, select, host, list(columns), scale, shard, undo=undo)
        # local work from here on: every collective of this micro-step is behind
        if host or (select and k != 0):
            self.join()  # the overlapped update of the last interval
        if not device_part:
            return staged
        # fp16: unscaled (DeepSpeed's is not, and the square of a loss-scaled gradient
        # overflows its fp16 moments); the loss scale is 1 otherwise.
        assert parts is not None
        dev_scale = 1.0 / (self.schedule.grad_divisor * scale)
        h, vals = self.u.group.hyper, self.values
        before = vals.read_all(columns)  # a swap file's reads; one transfer from host memory
        grads_here = transfer_all(parts, before[0].device) if before else parts  # one copy
        new = []
        for i, (c, g) in enumerate(zip(columns, grads_here)):
            v, after = adamw_step(before[i], g.float() * dev_scale, c, h)
            new.append(v)
            staged.columns[i] = after
        staged.values = new
        if not (host or select):  # written now, undone by writing ``before`` back
            undo.values = (columns, before)
            self._write_values(columns, new)
            staged.written = True
        return staged

    def commit(self, u: HostUpdate) -> None:
        staged, self._held = self._held, None
        if staged is None:
            return
        s, sched = staged, self.schedule
        # each micro-step's gradient unscaled by its own loss scale, divided by U as DeepSpeed
        # divides the loss (the interval's gradients are then one scale's, whatever fp16 did)
        self.accum.add_(s.shard, alpha=1.0 / (sched.grad_divisor * s.scale))
        if s.shard.dtype == torch.bfloat16:
            # DeepSpeed accumulates the interval's bf16 gradients in bf16 (its default
            # gradient_accumulation_dtype): each sum rounded to it. fp16 stays fp32: a sum of
            # fp16 gradients may overflow where each one did not.
            self.accum.copy_(self.accum.to(s.shard.dtype))
        if s.select and s.k != 0:
            self.u.master_from_params()
        self.columns = list(s.columns)
        if s.host:
            # stage 3 with a device part: its own publish follows (one drop of the stale
            # gathered copies and one gather of the persistent params per step, not two)
            self._host_part(s.k + 1, publish=s.values is None or not self.stage3)
        if s.values is not None and not s.written:
            self._write_values(s.columns, s.values)
        self.micro += 1
        self.u.step_count = self.micro  # committed micro-steps: each is an update
        self._flushed = False

    def rollback(self, u: HostUpdate) -> None:
        staged, self._held = self._held, None
        if staged is not None:
            self._undo(staged.undo)

    def _undo(self, undo: _Undo) -> None:
        """What a staged micro-step changed, put back: the values the device part wrote, the
        positions of a stage-3 selection, the "auto" rule's sums."""
        if undo.values is not None:
            columns, before = undo.values
            self._write_values(columns, before)
        if undo.index is not None:
            self.values.swap(undo.index)
        if undo.auto is not None:
            self.auto.restore(undo.auto)

    def _write_values(self, columns: list[ColumnState], values: list[torch.Tensor]) -> None:
        vals = self.values
        vals.begin()
        vals.write_all(columns, values)
        vals.end()

    def join(self) -> None:
        """Wait for a running host update (only the overlapped path has one)."""

    def _host_factor(self) -> float:
        """The accumulated gradient's clip, as DeepSpeed's step computes it (the accumulator is
        unscaled already: each micro-step's gradient by its own loss scale)."""
        # one pass of the SIMD kernel (fp32 accumulation per thread): a float64 copy of the
        # whole shard was the largest cost of a host update on a CPU
        sumsq = float(sum_of_squares(self.accum))
        if self.world > 1:  # the whole accumulated gradient's norm: every rank's squares
            t = torch.tensor([sumsq], dtype=torch.float64, device=self.u.group.device)
            dist.all_reduce(t)
            sumsq = float(t[0])
        norm = math.sqrt(sumsq)
        combined = 1.0
        if self.clip > 0:
            coef = (norm + 1e-6) / self.clip
            if coef > 1:
                combined = coef
        return 1.0 / combined

    def _host_part(self, step: int, publish: bool = True) -> None:
        """The host Adam over the whole shard with the accumulated gradient, as DeepSpeed's
        step at its accumulation boundary: the norm's clip, bias correction at ``step``;
        ``publish`` False: the caller publishes the home after writing it again."""
        factor = self._host_factor()
        self.u.home.prepare_write()
        self.u.step_count = step
        self.u.host_pass(self.accum, factor, self.u._hyper(), upload=True)
        if publish:
            self.u.home.publish()
        self.accum.zero_()

    def prepare(self, u: HostUpdate) -> None:
        """Nothing to start before a micro-step."""

    def close(self) -> None:
        """Nothing held beyond memory (the overlapped runner finishes its update)."""

    def params_after_load(self) -> bool:
        """The params after a load are the master's cast (the overlapped runner's are not)."""
        return False

    def nbytes(self) -> dict[str, int]:
        out: dict[str, int] = {}
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
                if t is not None and t.device == self.u.group.device:
                    yield StateBuffer(t, "device.zenflow_columns", state=opt)
        if self.stage3:  # the held elements' positions beside a device param shard
            for t in self.values.device_index():
                yield StateBuffer(t, "device.zenflow_columns", state=opt)
        for t in self.step_grads.buffers():  # several ranks: rewritten by every step's reduce
            grads = OffloadStateType.lp_grads
            yield StateBuffer(t, "device.zenflow_grad", keep=False, state=grads)

    # ---- what a checkpoint keeps beyond the master and the host moments -----------------------
    def flush(self, u: HostUpdate) -> None:
        """The master takes the device part's values of the selected columns (and the 1-D
        params), so that a checkpoint's master is the live params. Training is unchanged: the
        host update's result for them is discarded, and a selection resets them anyway. Done
        once per committed micro-step (the fragment API flushes at every call)."""
        if self._flushed or self.micro == 0:
            return
        self._master_takes_live_values()
        self._flushed = True

    def _master_takes_live_values(self) -> None:
        if self.stage3:
            if not self.u.aliased:  # the held elements' live values, at their shard positions
                for i, c in enumerate(self.columns):
                    ix = self.values.index[i]
                    self.u.master[ix] = self.values.read(i, c).to(self.u.master.dtype).cpu()
            return
        for i, (p, c) in enumerate(zip(self.u.group.params, self.columns)):
            if p.dim() != 1 and c.columns is None:
                continue
            live = p.detach().to(self.u.master.device, self.u.master.dtype)
            if p.dim() != 1:  # the master's own values, the selected columns' live ones
                mask = torch.zeros(p.shape, dtype=torch.bool, device=live.device)
                mask[:, c.columns.to(live.device)] = True
                live = torch.where(mask, live, self._master_param(i).view(p.shape))
            self._write_param_master(i, live.reshape(-1))

    def _owned(self, i: int) -> Iterator[tuple[int, int, int]]:
        """(param offset, shard offset, count) of each piece of param ``i`` in this shard."""
        lo, hi = self.ranges[i]
        for s in self.u.segs:
            a, b = max(lo, s.flat_start), min(hi, s.flat_start + s.numel)
            if a < b:
                yield a - lo, s.shard_start + a - s.flat_start, b - a

    def _master_param(self, i: int) -> torch.Tensor:
        """Param ``i`` (flat) as the master holds it (zero where another rank's)."""
        lo, hi = self.ranges[i]
        out = torch.zeros(hi - lo, dtype=self.u.master.dtype, device=self.u.master.device)
        for at, sh, n in self._owned(i):
            out[at : at + n] = self.u.master[sh : sh + n]
        return out

    def _write_param_master(self, i: int, flat: torch.Tensor) -> None:
        for at, sh, n in self._owned(i):
            self.u.master[sh : sh + n] = flat[at : at + n]

    def extra_state(self) -> dict[str, torch.Tensor]:
        """The mid-interval state: the micro-step count, the accumulated host gradient, and
        per param the selected columns, their device moments and step count."""
        out = {"zenflow.micro": torch.tensor([self.micro]), "zenflow.accum": self.accum}
        if self.auto is not None:
            out.update(self.auto.state(self.u.group.index, len(self.u.group.params)))
        for i, c in enumerate(self.columns):
            out[f"zenflow.{i}.step"] = torch.tensor([c.step])
            named = (("columns", c.columns), ("exp_avg", c.exp_avg), ("exp_avg_sq", c.exp_avg_sq))
            for name, t in named:
                if t is not None:
                    out[f"zenflow.{i}.{name}"] = t.detach().cpu().contiguous()
        return out

    def check_extra_state(self, fetch: Fetch, step_count: int, same_world: bool) -> None:
        """Refuse saved ZenFlow state this run cannot continue from (``ValueError`` naming the
        tensor): counters that disagree with the group's step count, columns out of range,
        repeated or of another count, moments of another shape, values not finite, parts
        missing. ``same_world``: saved on as many ranks (another count starts afresh)."""
        micro, accum = fetch("zenflow.micro"), fetch("zenflow.accum")
        if micro is None and accum is None:
            return  # no ZenFlow state: it starts afresh (warned at the load)
        if micro is None or accum is None:
            raise ValueError("zenflow.micro and zenflow.accum are saved together: one is missing")
        m = _count(micro, "zenflow.micro")
        if m != step_count:
            raise ValueError(
                f"zenflow.micro is {m} but the group's step count is {step_count}: every "
                "committed micro-step counts once in both"
            )
        if accum.numel() != self.accum.numel():
            if same_world:
                raise ValueError(
                    f"zenflow.accum has {accum.numel()} elements, this rank's shard "
                    f"{self.accum.numel()}"
                )
            return  # saved on another number of ranks: afresh
        _finite(accum, "zenflow.accum")
        if self.auto is not None and m > 0 and fetch("zenflow.auto") is None:
            raise ValueError('zenflow.auto is missing: update_interval "auto" needs its counters')
        for i, n in enumerate(self.counts()):
            self._check_param(fetch, i, n, m)

    def _check_param(self, fetch: Fetch, i: int, n: int, micro: int) -> None:
        name = f"zenflow.{i}"
        step = fetch(f"{name}.step")
        if step is None:
            raise ValueError(f"{name}.step is missing")
        if not 0 <= _count(step, f"{name}.step") <= micro:
            raise ValueError(f"{name}.step is {int(step.reshape(-1)[0])}, not in 0..{micro}")
        cols = fetch(f"{name}.columns")
        if self.whole[i] and cols is not None:
            raise ValueError(f"{name}.columns: param {i} is updated whole, it has no columns")
        if cols is not None:
            ncols = self.shapes[i][1]
            ok = cols.dtype == torch.int64 and cols.dim() == 1 and cols.numel() == n
            if not ok:
                raise ValueError(
                    f"{name}.columns must be {n} int64 column indices, not {cols.dtype} of "
                    f"shape {list(cols.shape)}"
                )
            inside = bool(((cols >= 0) & (cols < ncols)).all())
            if not inside or (n > 1 and not bool((cols[1:] > cols[:-1]).all())):
                raise ValueError(
                    f"{name}.columns must be increasing column indices in 0..{ncols - 1}, each once"
                )
        elif not self.whole[i] and micro > self.schedule.full_warm_up_rounds:
            raise ValueError(f"{name}.columns is missing (the columns were selected)")
        moments = [fetch(f"{name}.{k}") for k in ("exp_avg", "exp_avg_sq")]
        if (moments[0] is None) != (moments[1] is None):
            raise ValueError(f"{name}.exp_avg and {name}.exp_avg_sq are saved together")
        if moments[0] is None:
            return
        want = self._device_shape(i, cols)
        for k, t in zip(("exp_avg", "exp_avg_sq"), moments):
            if tuple(t.shape) != want:
                raise ValueError(f"{name}.{k} has shape {list(t.shape)}, the columns' {list(want)}")
            _finite(t, f"{name}.{k}")

    def _device_shape(self, i: int, cols: torch.Tensor | None) -> tuple[int, ...]:
        """The shape of param ``i``'s device-part values (and moments) for ``cols``."""
        if self.stage3:
            return (self.values.index_of(i, None if self.whole[i] else cols).numel(),)
        shape = self.shapes[i]
        return shape if cols is None else (shape[0], cols.numel())

    def extra_digest(self, fetch: Fetch) -> torch.Tensor | None:
        """What every rank's saved ZenFlow state must agree on (the micro-step, the columns),
        as numbers the load compares across ranks; None without ZenFlow state."""
        micro = fetch("zenflow.micro")
        if micro is None:
            return None
        acc = torch.zeros(2, dtype=torch.int64)
        for i in range(len(self.shapes)):
            cols = fetch(f"zenflow.{i}.columns")
            if cols is not None:
                w = torch.arange(1, cols.numel() + 1, dtype=torch.int64) * (i + 1)
                acc[0] += int((cols.to(torch.int64) * w).sum()) % (1 << 40)
                acc[1] += cols.numel()
        return torch.cat([micro.reshape(-1)[:1].to(torch.int64), acc])

    def load_extra_state(self, fetch: Callable[[str], torch.Tensor | None]) -> None:
        """``extra_state`` back (``fetch(name)``: None when the checkpoint has no such tensor;
        ``restored``: whether it was). A checkpoint without ZenFlow's state, or with another shard
        size (saved on another number of ranks), starts it afresh on every rank alike: a
        selection at the next step."""
        micro, accum = fetch("zenflow.micro"), fetch("zenflow.accum")
        fits = micro is not None and accum is not None and accum.numel() == self.accum.numel()
        if self.world > 1:  # every rank restores, or none: their schedules stay one
            misfits = torch.tensor([0 if fits else 1], device=self.u.group.device)
            dist.all_reduce(misfits)
            fits = int(misfits[0]) == 0
        if micro is not None and not fits:
            log.warning(
                "zero_optimization.zenflow: the checkpoint's ZenFlow state was saved on another "
                "number of ranks; ZenFlow starts afresh (a selection at the next step)"
            )
        self.accum.zero_()
        self._flushed = False
        self.columns = [ColumnState(None) for _ in self.u.group.params]
        self.micro = int(micro[0]) if fits else 0
        self.restored = fits
        if not fits:
            return
        self.accum.copy_(accum)
        if self.auto is not None:
            self.auto.load_state(self.u.group.index, len(self.u.group.params), fetch)
        for i, c in enumerate(self.columns):
            c.step = int(fetch(f"zenflow.{i}.step")[0])
            for name in ("columns", "exp_avg", "exp_avg_sq"):
                t = fetch(f"zenflow.{i}.{name}")
                if t is not None:
                    setattr(c, name, t.to(self.u.group.device))
            if self.stage3 and not self.whole[i] and c.columns is not None:
                self.values.select(i, c.columns)
