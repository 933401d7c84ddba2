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

import torch
import torch.distributed as tdist

from ...core import dist, host_memory
from ...core.flat_group import FlatGroup
from ...core.labels import REDUCE, label
from ...core.layout import Segment
from ...core.streams import Streams
from ..backward_scope import BackwardScope
from .grad_shard import GradShard
from .reduce_buffers import ReduceBuffers


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
        bucket_size: int = 500_000_000,
    ) -> None:
        """``average``: gradients averaged over the ranks (``gradient_allreduce_op`` "mean",
        DeepSpeed's default), else summed ("sum"). ``bucket_size``: ``reduce_bucket_size``, the
        largest stage-2/3 reduction input (see reduce_buffers.py)."""
        self.groups, self.shards, self.stage = groups, shards, stage
        self.overlap, self.streams = overlap, streams
        # gloo's reduce-scatter is an all-reduce of a copy of the input: the same sums as an
        # all-reduce of the input itself (a scratch bucket), which leaves no bucket-sized
        # temporary per reduction in malloc's heap (core/host_memory.py)
        self.use_rs = reduce_scatter and not _reduce_scatter_copies_input(streams)
        # CUDA: with overlap_comm, collectives run on the reduce stream; without, on the
        # compute stream (None = current), ordered with backward.
        self.stream = streams.reduce if overlap else None
        self.world, self.rank = dist.world_size(), dist.rank()
        self.average = average
        # Global launch order: a bucket is expected done when its earliest-registered param is.
        keys = []
        for g in groups:
            for b in g.layout.buckets:
                last = max(global_pos[id(g.params[i])] for i in b.params)
                keys.append((last, g.index, b.index))
        self.order = [(gi, bi) for _, gi, bi in sorted(keys)]
        self.launch_pos = {key: k for k, key in enumerate(self.order)}
        self.learned = False  # the order was replaced by the one backward completes buckets in
        self.bucket_of = [g.layout.param_bucket() for g in groups]
        self.ignore_unused = ignore_unused
        self.bufs = ReduceBuffers(
            groups, bucket_size, self.world, (streams.reduce, streams.d2h), self._direct
        )
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

    def _direct(self, key: tuple[int, int]) -> torch.Tensor | None:
        """One rank: the reduce-scatter is the identity, so a bucket may be gathered right in
        its reduce target (the grad shard's segment on a micro-step that overwrites it)."""
        if self.world > 1:
            return None
        seg = self.shards[key[0]].segs[key[1]]
        return self.shards[key[0]].reduce_target(seg)

    # ---- per-backward state --------------------------------------------------------------------
    def _reset(self) -> None:
        self.pending = {
            (g.index, b.index): len(b.params) for g in self.groups for b in g.layout.buckets
        }
        self.bufs.clear()
        self.completed: list[tuple[int, int]] = []  # buckets in the order they completed
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
                self.bufs.add(key, i, p.grad, again)
                p.grad = None  # copied into a bucket buffer, or held by it until reduced
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
            if self.pending[key] == 0:
                self.completed.append(key)
            self._launch_ready()

        return hook

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
        """Launch a bucket's collectives: stage 0/1 one on the flat grad range; stage 2/3 one
        per piece (see reduce_buffers.py), each completed like any other in-flight entry."""
        g, shard = self.groups[key[0]], self.shards[key[0]]
        b = g.layout.buckets[key[1]]
        seg = shard.segs[key[1]]
        s = self.streams
        if self.stage <= 1:
            # The input first: with an fp32 accumulator it is an add_ queued on the compute
            # stream, which the reduce stream's wait must cover (waiting first let the norm, the
            # clip, the host copy and the collective read ``accum`` before the add landed).
            inp = shard.bucket_input(b)
            s.wait(self.stream, None)
            self._collective(key, seg, inp, seg.flat_start - b.start, True)
            return
        s.wait(self.stream, None)
        # One piece at a time, each assembled (on the reduce stream) only after the one before
        # was launched and the one before that completed: at most two pieces' buffers alive.
        pieces = self.bufs.pieces(key)
        for k in range(self.bufs.count(key)):
            with s.use(self.stream):
                pc = next(pieces)
            sub = Segment(seg.bucket, seg.flat_start + pc.lo, seg.shard_start + pc.lo, pc.numel)
            self._collective(key, sub, pc.inp, self.rank * pc.numel, k == self.bufs.count(key) - 1)

    def _collective(self, key, seg: Segment, inp: torch.Tensor, lo: int, last: bool) -> None:
        """``lo``: where this rank's part sits in ``inp`` (the all-reduce path keeps only it);
        ``last``: the bucket's final collective (its held gradients are freed after it)."""
        s = self.streams
        with s.use(self.stream):
            if self.world > 1 and self.average:
                inp.mul_(1.0 / self.world)  # average; pre-divided so fp16 sums stay in range
            async_op = self.overlap and not s.cuda
            if self.stage == 0:
                out = inp
                work = dist.all_reduce(inp, async_op=async_op)
            else:
                out = self.shards[key[0]].reduce_target(seg)
                if out is None:  # world 1: the input is the result, no temporary
                    out = inp if self.world == 1 else _scratch(seg.numel, inp)
                if self.use_rs:
                    work = dist.reduce_scatter(out, inp, async_op=async_op)
                else:  # all-reduce, then keep this rank's slice
                    work = dist.all_reduce(inp, async_op=async_op)
            self.inflight.append((work, key, seg, inp, out, lo, last))
        if s.cuda or not self.overlap:  # CUDA: the follow-up ops are only enqueued
            self._complete(len(self.inflight) - 1)
        elif len(self.inflight) > 1:  # gloo: one collective in flight while the next one fills
            self._complete(len(self.inflight) - 2)

    def _complete(self, upto: int) -> None:
        """Finish in-flight collectives [0, upto] in launch order."""
        s = self.streams
        done, self.inflight = self.inflight[: upto + 1], self.inflight[upto + 1 :]
        for work, key, seg, inp, out, lo, last in done:
            if work is not None:
                work.wait()
            with s.use(self.stream):
                if self.stage >= 1 and not self.use_rs and out.data_ptr() != inp[lo:].data_ptr():
                    out.copy_(inp[lo : lo + seg.numel])
                self.shards[key[0]].accept(seg, out, self.last)
            if self.stage == 2:
                keep = lambda t: s.keep_alive(t, self.stream)  # noqa: E731
                self.bufs.release(key, inp, keep)
                if last:
                    self.bufs.drop_held(key, keep)

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
        if not self.reducing:
            for shard in self.shards:
                shard.fold_micro_step()  # stage 0/1 with an fp32 accumulator (else nothing)
        if self.reducing:
            self._launch_ready(force=True)
            if self.inflight:
                self._complete(len(self.inflight) - 1)
            self.streams.wait(None, self.stream)
            if not self.learned:
                self._learn_order()
        self._reset()

    def _learn_order(self) -> None:
        """After the first reducing backward: launch buckets in the order that backward
        completed them (unused ones after, in the old order), so a bucket that completes early
        never waits, holding its buffer, behind one that completes late (a stage-3 layer's
        norms are registered after, but run before, its linears: up to a layer of buffers
        waited). The order stays fixed and is taken only where every rank saw the same one."""
        self.learned = True
        seen = set(self.completed)
        order = self.completed + [k for k in self.order if k not in seen]
        if self.world > 1:
            orders: list = [None] * self.world
            dist.all_gather_object(orders, order)
            if any(o != order for o in orders):
                return
        self.order = order
        self.launch_pos = {key: k for k, key in enumerate(order)}

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

    def bounds(self) -> dict[str, int]:
        """Stage 2/3: the working-set bytes the config allows (see ``ReduceBuffers.bounds``)."""
        if self.stage != 2 or not self.groups:
            return {}
        return self.bufs.bounds(self.groups[0].dtype.itemsize)

    def transient_peaks(self) -> dict[str, int]:
        """Stage 2/3: the most bytes of reduce buffers and of held full gradients at once."""
        if self.stage != 2:
            return {}
        return {f"device.{k}": v for k, v in self.bufs.peak.items()}

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _scratch(numel: int, like: torch.Tensor) -> torch.Tensor:
    """A reduce-scatter's output of ``numel`` elements, freed after its copy: on a CPU a mapping
    of its own, which leaves no free heap behind (core/host_memory.py)."""
    return host_memory.empty(numel, like.dtype, like.device)


def _reduce_scatter_copies_input(streams: Streams) -> bool:
    """torch's gloo backend reduce-scatters CPU tensors by cloning the input, all-reducing the
    clone and copying this rank's slice out: a malloc block of the bucket's size each time,
    freed at once, which stays resident as free heap. NCCL reduce-scatters in place."""
    return not streams.cuda and dist.is_distributed() and tdist.get_backend() == "gloo"
