"""How gradients leave the backward pass.

Post-accumulate-grad hooks count, per bucket, the params whose gradient is final for this
backward. A complete bucket is reduced: all-reduce (stage 0), reduce-scatter of the flat grad
(stage 1) or of a grad bucket buffer the hooks copied the gradients into (stage 2, whose
``p.grad`` is freed at once). Stage 0/1 reduce only on the micro-step that ends an accumulation
window; stage 2 on every micro-step, folding the result into the grad shard.

Invariant: buckets are launched in one fixed global order (by when backward is expected to finish
them), never in arrival order, so every rank issues the same collectives in the same order. A
bucket whose params got no gradient (unused params) is launched, with zeros, at the end of
backward.

A param's gradient is final at its first post-accumulate hook of a backward. A second one (the
param is used both inside and outside a reentrant checkpoint, two graph tasks) is added to the
first while its bucket has not been reduced, and is an error once it has: it would be lost.

The backward's start and end are the ``BackwardScope``'s (the end of the outermost graph task).
A plain ``loss.backward()`` carries no 1/GAS in its loss, so the scope's prologue sets
``grad_factor`` and a pre-hook on each param (registered at the first such backward) scales
the gradient before it accumulates.

With ``overlap_comm`` the collective of a bucket runs while backward continues (on the reduce
stream under CUDA; as an async work handle on gloo: one bucket reducing while the next fills); without it each
reduction completes before the hook returns.
"""

from __future__ import annotations

import collections

import torch

from ...core import dist
from ...core.flat_group import FlatGroup
from ...core.labels import REDUCE, label
from ...core.streams import Streams
from ..backward_scope import BackwardScope
from .grad_shard import GradShard


class UnusedParamsError(RuntimeError, AssertionError):
    """Trainable params got no gradient while ``ignore_unused_parameters`` is false (DeepSpeed
    asserts: code that catches ``AssertionError`` for it catches this too)."""


class Reducer:
    def __init__(
        self,
        groups: list[FlatGroup],
        shards: list[GradShard],
        stage: int,
        overlap: bool,
        reduce_scatter: bool,
        streams: Streams,
        global_pos: dict[int, int],
        scope: BackwardScope,
        ignore_unused: bool = True,
        average: bool = True,
    ) -> None:
        """``average``: gradients averaged over the ranks (``gradient_allreduce_op`` "mean",
        DeepSpeed's default), else summed ("sum")."""
        self.groups, self.shards, self.stage = groups, shards, stage
        self.overlap, self.use_rs, self.streams = overlap, reduce_scatter, streams
        # CUDA: with overlap_comm, collectives run on the reduce stream; without, on the
        # compute stream (None = current), ordered with backward.
        self.stream = streams.reduce if overlap else None
        self.world = dist.world_size()
        self.average = average
        # Global launch order: a bucket is expected done when its earliest-registered param is.
        keys = []
        for g in groups:
            for b in g.layout.buckets:
                last = max(global_pos[id(g.params[i])] for i in b.params)
                keys.append((last, g.index, b.index))
        self.order = [(gi, bi) for _, gi, bi in sorted(keys)]
        self.launch_pos = {key: k for k, key in enumerate(self.order)}
        self.bucket_of = [g.layout.param_bucket() for g in groups]
        self.ignore_unused = ignore_unused
        # Free stage-2 bucket buffers, oldest first, each with the event after which it is free.
        self.pool: collections.deque = collections.deque()
        self.pool_size = 0
        self.max_bucket = max((b.numel for g in groups for b in g.layout.buckets), default=0)
        self.reducing = False  # does this backward reduce (stage 2: always; 0/1: at boundary)
        self.last = True
        self.grad_factor = 1.0  # applied to each gradient before it accumulates
        self.scope = scope
        self._reset()
        self.handles = []
        self._scaling = False  # the pre-hooks below exist (registered at the first need)
        for g in groups:
            for i, p in enumerate(g.params):
                self.handles.append(p.register_post_accumulate_grad_hook(self._hook(g.index, i)))
        scope.on_end(self._finish_backward, self._abandon)

    # ---- per-backward state --------------------------------------------------------------------
    def _reset(self) -> None:
        self.pending = {
            (g.index, b.index): len(b.params) for g in self.groups for b in g.layout.buckets
        }
        self.buffers: dict[tuple[int, int], torch.Tensor] = {}
        self.next = 0  # index into self.order of the next bucket to launch
        self.inflight: list = []
        self.arrived: set[tuple[int, int]] = set()  # (group, param) that got a gradient

    def _abandon(self) -> None:
        """A backward that raised part way: the reductions it launched finish before anything
        else touches their buffers (``zero_grad`` on the compute stream, the next backward);
        their results are dropped. Without this, a gloo handle or the reduce and d2h streams
        could write the gradient shards after they were zeroed."""
        for work, *_ in self.inflight:
            if work is not None:
                try:
                    work.wait()
                except Exception:  # the backward's own error is the one raised
                    pass
        self.streams.wait(None, self.stream)
        self.streams.wait(None, self.streams.d2h)
        self._reset()

    def prepare(self, first: bool, last: bool, grad_factor: float = 1.0) -> None:
        """Called by the engine's backward prologue."""
        self.last, self.grad_factor = last, grad_factor
        for shard in self.shards:
            shard.begin_backward(first)
        self.reducing = self.stage == 2 or last
        if grad_factor != 1.0 and not self._scaling:  # a plain loss.backward() with GAS > 1
            self._scaling = True
            for g in self.groups:
                for p in g.params:
                    self.handles.append(p.register_hook(self._scale))

    def _scale(self, grad: torch.Tensor) -> torch.Tensor | None:
        return None if self.grad_factor == 1.0 else grad * self.grad_factor

    # ---- hooks ---------------------------------------------------------------------------------
    def _hook(self, gi: int, i: int):
        def hook(p: torch.Tensor) -> None:
            self.scope.ensure()
            key = (gi, self.bucket_of[gi][i])
            again = (gi, i) in self.arrived
            if again and self.reducing and self.launch_pos[key] < self.next:
                raise RuntimeError(
                    f"parameter {self.groups[gi].names[i]!r} received a second gradient in one "
                    "backward after its bucket was already reduced (it is used both inside and "
                    "outside a reentrant activation checkpoint); use "
                    "torch.utils.checkpoint(..., use_reentrant=False) for that block"
                )
            self.arrived.add((gi, i))
            if self.stage == 2:
                g = self.groups[gi]
                b = g.layout.buckets[key[1]]
                off = g.layout.offsets[i] - b.start
                dst = self._buffer(key)[off : off + p.numel()]
                if again:
                    dst.add_(p.grad.reshape(-1))
                else:
                    dst.copy_(p.grad.reshape(-1))
                p.grad = None  # the unowned (and owned) full gradient is released here
            else:
                view = self.shards[gi].views[i]
                if p.grad is not view:  # the caller replaced .grad (e.g. module.zero_grad())
                    view.copy_(p.grad)
                    p.grad = view
                if not self.reducing:
                    return
            if again:
                return  # counted at its first arrival
            self.pending[key] -= 1
            self._launch_ready()

        return hook

    def _buffer(self, key) -> torch.Tensor:
        entry = self.buffers.get(key)
        if entry is None:
            g = self.groups[key[0]]
            # Reuse the oldest free buffer once two exist (the two alternating buckets of
            # overlap_comm), or when its collective already finished; otherwise grow the pool.
            if self.pool and (
                self.pool_size >= 2 or self.pool[0][1] is None or self.pool[0][1].query()
            ):
                full, ev = self.pool.popleft()
                if (
                    ev is not None
                ):  # the compute stream refills it only after the collective read it
                    torch.cuda.current_stream().wait_event(ev)
            else:
                full = torch.empty(self.max_bucket, dtype=g.dtype, device=g.device)
                self.pool_size += 1
            view = full[: g.layout.buckets[key[1]].numel]
            view.zero_()  # padding and params without a gradient reduce as zeros
            entry = self.buffers[key] = (full, view)
        return entry[1]

    def _launch_ready(self, force: bool = False) -> None:
        while self.next < len(self.order):
            key = self.order[self.next]
            if self.pending[key] > 0 and not force:
                return
            self.next += 1
            with label(REDUCE):
                self._launch(key)

    # ---- reduction -----------------------------------------------------------------------------
    def _launch(self, key) -> None:
        gi, bi = key
        g, shard = self.groups[gi], self.shards[gi]
        b = g.layout.buckets[bi]
        seg = shard.segs[bi]
        s = self.streams
        inp = shard.bucket_input(b) if self.stage <= 1 else self._buffer(key)
        s.wait(self.stream, None)
        with s.use(self.stream):
            if self.world > 1 and self.average:
                inp.mul_(1.0 / self.world)  # average; pre-divided so fp16 sums stay in range
            async_op = self.overlap and not s.cuda
            if self.stage == 0:
                out = inp
                work = dist.all_reduce(inp, async_op=async_op)
            else:
                out = shard.reduce_target(seg)
                if out is None:
                    out = torch.empty(seg.numel, dtype=inp.dtype, device=inp.device)
                if self.use_rs:
                    work = dist.reduce_scatter(out, inp, async_op=async_op)
                else:  # all-reduce, then keep this rank's slice
                    work = dist.all_reduce(inp, async_op=async_op)
            self.inflight.append((work, key, seg, inp, out))
        if s.cuda or not self.overlap:  # CUDA: the follow-up ops are only enqueued
            self._complete(len(self.inflight) - 1)
        elif len(self.inflight) > 1:  # gloo: one bucket in flight while the next one fills
            self._complete(len(self.inflight) - 2)

    def _complete(self, upto: int) -> None:
        """Finish in-flight reductions [0, upto] in launch order."""
        s = self.streams
        done, self.inflight = self.inflight[: upto + 1], self.inflight[upto + 1 :]
        for work, key, seg, inp, out in done:
            if work is not None:
                work.wait()
            with s.use(self.stream):
                if self.stage >= 1 and not self.use_rs:
                    lo = seg.flat_start - self.groups[key[0]].layout.buckets[key[1]].start
                    if out.data_ptr() != inp[lo:].data_ptr():
                        out.copy_(inp[lo : lo + seg.numel])
                self.shards[key[0]].accept(seg, out, self.last)
            if self.stage == 2:
                self._release(key)

    def _release(self, key) -> None:
        full, _ = self.buffers.pop(key)
        self.pool.append((full, self.streams.record(self.stream)))

    def _finish_backward(self) -> None:
        """End of backward: launch what is left (unused params), complete every reduction."""
        if self.reducing and not self.ignore_unused and any(self.pending.values()):
            missing = [
                g.names[i]
                for g in self.groups
                for i in range(len(g.params))
                if (g.index, i) not in self.arrived
            ]
            self._reset()
            raise UnusedParamsError(
                "zero_optimization.ignore_unused_parameters is false and these parameters got no "
                f"gradient in this backward: {missing}; set it to true to reduce them as zeros"
            )
        if self.reducing:
            self._launch_ready(force=True)
            if self.inflight:
                self._complete(len(self.inflight) - 1)
            self.streams.wait(None, self.stream)
        self._reset()

    def finish_window(self) -> None:
        """``managed_gradient_accumulation`` false: ``step()`` ends the window. Stages 0/1
        reduce the gradients accumulated in the flat buffer now (every bucket, in the fixed
        order); stage 2/3 segments were reduced by each backward and are finalized instead."""
        if self.stage == 2:
            for shard in self.shards:
                shard.finalize()
            return
        self.prepare(first=True, last=True)
        self._launch_ready(force=True)
        if self.inflight:
            self._complete(len(self.inflight) - 1)
        self.streams.wait(None, self.stream)
        self._reset()

    def bucket_pool_bytes(self) -> int:
        if self.stage != 2:
            return 0
        esize = self.groups[0].dtype.itemsize if self.groups else 0
        return self.pool_size * self.max_bucket * esize

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
