"""Where this rank's reduced gradient lives, and how a reduced bucket gets there.

- stage 0: the flat grad buffer itself (all-reduced in place; every rank holds all of it);
- stage 1: this rank's slices of the flat grad buffer (reduce-scattered in place);
- stage 0/1 with a wider accumulator (``data_types.grad_accum_dtype`` "fp32" with bf16 params):
  ``p.grad`` (the 16-bit flat grad) holds one micro-step's gradient; each backward adds it into
  a full-length fp32 flat accumulator (``accum``), which the boundary reduces in fp32 and the
  update reads (DeepSpeed's BF16_Optimizer: the window's sum is never rounded to 16 bits);
- stage 2: a device grad shard accumulated over micro-steps (absent with offload and one
  micro-step per step: the reduced slice then goes straight to the host);
- offload: a host grad shard in the accumulation dtype (two of them with the delayed update,
  alternating, so the next step's copies never overwrite what the host update is reading);
- partial offload (a twin update, ``host_from`` > 0): only the host part ``[host_from, numel)``
  is copied to the host (its buffer is in the part's coordinates); the device part stays in a
  device grad shard of ``host_from`` elements (or in the full device accumulator).

Several backwards before one ``step()`` after the window's end (two losses, a loss per
sub-batch): each one after the first ``reopen``s the window. Stage 2/3 add the next backward's
reduced gradient into a device grad shard (made whole, from the host copy, where offload kept
none); stage 0/1 reduce in place, so the reduced sum so far is kept aside (``carry``) and added
to each segment as it is reduced again. Either way every segment's norm and host copy are
redone from the window's new sum, as ``backward(l1 + l2)`` would have produced them.

Invariant: the host grad shard has the accumulator's dtype, so an fp32 accumulator
(``data_types.grad_accum_dtype`` "fp32" with 16-bit params) reaches the host update unrounded;
a 16-bit host copy would round the window's sum once more, which the device update never does.

The squared norm of every final segment is summed on the device as it is produced, so the global
norm, the overflow check and the clip factor are known before the host reads any gradient (a
segment in host memory, CPU training, is summed by the SIMD kernel of ``kernels/sumsq.py``).
"""

from __future__ import annotations

import torch

from ...core.flat_group import FlatGroup
from ...core.labels import GRAD_D2H, GRAD_WAIT, label
from ...core.layout import Bucket, Segment
from ...core.pinned_bytes import host_bytes
from ...core.streams import Streams, alloc_host
from ...kernels.sumsq import sum_of_squares


class GradShard:
    def __init__(
        self,
        group: FlatGroup,
        stage: int,
        offload: bool,
        gas: int,
        streams: Streams,
        pin: bool,
        host_buffers: int = 1,
        accum_dtype: torch.dtype | None = None,
        host_from: int = 0,
    ) -> None:
        """``accum_dtype``: the dtype of the device accumulator and of the host grad shard
        (fp32 with 16-bit params: ``data_types.grad_accum_dtype``); stages 0/1 accumulate in
        ``p.grad`` when it is the params' dtype, else in the flat accumulator ``accum``.
        ``host_from`` (with ``offload``): the shard offset where the host part begins
        (``Placement.host_from``); the elements before it are updated on the device."""
        self.group = group
        self.accum_dtype = accum_dtype or group.dtype
        self.stage = stage
        self.offload = offload
        self.streams = streams
        self.segs = group.segments(stage >= 1)
        numel = self.numel = group.shard_numel(stage >= 1)
        dev, dt = group.device, group.dtype
        self.flat_grad = None
        self.accum = None  # stage 0/1 with a wider accumulator: the window's full-length sum
        self.device_shard = None
        self.host_from = host_from if offload else numel
        if stage <= 1:
            # Invariant: p.grad is a view of flat_grad, so backward accumulates in place.
            self.flat_grad = torch.zeros(group.layout.total, dtype=dt, device=dev)
            self.views = group.param_views(self.flat_grad)
            for p, v in zip(group.params, self.views):
                p.grad = v
            if self.accum_dtype != dt:
                self.accum = torch.zeros(group.layout.total, dtype=self.accum_dtype, device=dev)
        elif not offload or gas > 1:
            self.device_shard = torch.zeros(numel, dtype=self.accum_dtype, device=dev)
        elif self.host_from > 0:  # a twin's device part, reduced into place
            self.device_shard = torch.zeros(self.host_from, dtype=self.accum_dtype, device=dev)
        host_numel = numel - self.host_from
        host_dt = self.accum_dtype  # the window's sum as accumulated: never rounded on the way
        self.host = (
            [alloc_host(host_numel, host_dt, pin).zero_() for _ in range(host_buffers)]
            if offload
            else []
        )
        self.host_index = 0
        # Squared norm of each final segment, by shard offset. Summed in offset order at the
        # step (``sumsq``), never in arrival order: the reducer's launch order is learned during
        # the first backward, so a run resumed from a checkpoint would otherwise add the same
        # numbers in another order and clip by a norm a few ulps apart.
        self._sq: dict[int, torch.Tensor] = {}
        # Stage 0/1 after ``reopen``: the window's reduced sum before the reopening backward,
        # by shard offset (None otherwise)
        self.carry: torch.Tensor | None = None
        self.zeroed = False  # zero() since the last backward began
        self.writes = True  # the current backward writes the device shard (see begin_backward)
        self.d2h_done = None  # event after the last host copy of this step (CUDA only)

    @property
    def sumsq(self) -> torch.Tensor:
        """This rank's squared gradient norm of the window (fp32, on the device)."""
        if not self._sq:
            return torch.zeros((), dtype=torch.float32, device=self.group.device)
        return torch.stack([self._sq[k] for k in sorted(self._sq)]).sum()

    def set_sumsq(self, value: torch.Tensor) -> None:
        """Replace the norm by one computed elsewhere (a gradient written through the
        tensor-fragment API)."""
        self._sq = {0: value.to(torch.float32).reshape(())}

    def ensure_device_accumulator(self) -> None:
        """Stage 2/3 with offload and no accumulation was built without a device grad shard
        (2/N bytes/param saved); a window of several backwards needs one to add into. Called
        before the window's first backward, so nothing is lost by starting from zeros."""
        numel = self.group.shard_numel(True)
        if self.stage >= 2 and (self.device_shard is None or self.device_shard.numel() < numel):
            self.device_shard = torch.zeros(numel, dtype=self.accum_dtype, device=self.group.device)

    def reopen(self) -> None:
        """A backward after the one that ended the window, before ``step()``: keep the window's
        reduced gradient and let that backward add to it and end the window again. Called
        before its ``begin_backward(first=False)``, so stage 2/3 add into the device shard."""
        self._sq.clear()  # every segment is reduced again: its norm is the new sum's
        if self.stage <= 1:
            src = self.flat_grad if self.accum is None else self.accum
            carry = torch.empty(self.numel, dtype=src.dtype, device=src.device)
            for seg in self.segs:  # this rank's reduced segments (their sum so far)
                carry[seg.shard_start : seg.shard_start + seg.numel].copy_(
                    src[seg.flat_start : seg.flat_start + seg.numel]
                )
            self.carry = carry
            src.zero_()  # the next backward's local gradient alone is reduced
            self.flat_grad.zero_()
            return
        d = self.device_shard
        if d is not None and d.numel() == self.numel:
            return  # the device shard holds the window's sum: the next backward adds into it
        # Offload kept only the host copy of [host_from, numel): the whole sum goes back to a
        # device shard (kept from now on, as a window of several micro-steps keeps it).
        if self.d2h_done is not None:
            self.d2h_done.synchronize()
        whole = torch.empty(self.numel, dtype=self.accum_dtype, device=self.group.device)
        if d is not None:
            whole[: d.numel()].copy_(d)
        whole[self.host_from :].copy_(self.host[self.host_index], non_blocking=False)
        self.device_shard = whole

    def finalize(self) -> None:
        """Stage 2/3, ``managed_gradient_accumulation`` false: every backward folded into the
        device accumulator without ending the window; ``step()`` ends it here (norm, host
        copy), as the last backward's fold would have."""
        assert self.device_shard is not None
        for seg in self.segs:
            self.accept(seg, self.device_shard[seg.shard_start : seg.shard_start + seg.numel], True)

    # ---- targets for the reducer -------------------------------------------------------------
    def bucket_input(self, b: Bucket) -> torch.Tensor:
        """Stage 0/1: the flat-grad range that is the bucket's reduction input (with an
        accumulator: its range, after this micro-step's gradient is added into it)."""
        grad = self.flat_grad[b.start : b.start + b.numel]
        if self.accum is None:
            return grad
        return self.accum[b.start : b.start + b.numel].add_(grad)

    def fold_micro_step(self) -> None:
        """Stage 0/1 with an accumulator, after a backward that does not reduce: add its
        16-bit gradient into the accumulator (cleared by the next ``begin_backward``)."""
        if self.accum is not None:
            self.accum.add_(self.flat_grad)

    def reduce_target(self, seg: Segment) -> torch.Tensor | None:
        """Where a collective may write this rank's reduced segment directly, or None for a temp."""
        if self.stage <= 1:
            src = self.flat_grad if self.accum is None else self.accum
            return src[seg.flat_start : seg.flat_start + seg.numel]
        d, end = self.device_shard, seg.shard_start + seg.numel
        if d is not None and self.writes and self.accum_dtype == self.group.dtype:
            # a segment across a twin's cut (or past its device part) goes through a temp
            return d[seg.shard_start : end] if end <= d.numel() else None
        return None  # later micro-steps add; another accumulator dtype always adds (zeroed)

    def accept(self, seg: Segment, reduced: torch.Tensor, last: bool) -> None:
        """Fold a reduced segment in (on the stream that reduced it, the current one).
        ``last``: the final micro-step of the accumulation window."""
        if self.carry is not None:  # stage 0/1, reopened: ``reduced`` is the flat buffer's
            reduced.add_(self.carry[seg.shard_start : seg.shard_start + seg.numel])
        final = self._fold(seg, reduced)
        if not last:
            return
        sq = sum_of_squares(final)  # host: the SIMD kernel; a device tensor: torch
        prev = self._sq.get(seg.shard_start)
        self._sq[seg.shard_start] = sq if prev is None else prev + sq
        lo = max(seg.shard_start, self.host_from)  # the segment's host part, if any
        if self.offload and lo < seg.shard_start + seg.numel:
            h = self.host_from
            host = self.host[self.host_index][lo - h : seg.shard_start + seg.numel - h]
            s = self.streams
            with label(GRAD_D2H):
                s.wait(s.d2h, None)
                with s.use(s.d2h):
                    host.copy_(final[lo - seg.shard_start :], non_blocking=s.cuda)
                    s.keep_alive(final, s.d2h)
                self.d2h_done = s.record(s.d2h)

    def _fold(self, seg: Segment, reduced: torch.Tensor) -> torch.Tensor:
        """Add (or, on a backward that writes, copy) ``reduced`` into the device shard where
        it covers the segment; the segment's window sum so far, one device tensor."""
        d = self.device_shard
        if d is None or seg.shard_start >= d.numel():
            return reduced
        end = min(seg.shard_start + seg.numel, d.numel())
        dst = d[seg.shard_start : end]
        if dst.data_ptr() != reduced.data_ptr():
            src = reduced[: end - seg.shard_start]
            if self.writes and self.accum_dtype == self.group.dtype:
                dst.copy_(src)  # only a twin's segment across its cut comes here
            else:
                dst.add_(src)
        return dst if end - seg.shard_start == seg.numel else reduced

    # ---- consumers ----------------------------------------------------------------------------
    def device_grads(self, segs: tuple[Segment, ...] | None = None) -> list[torch.Tensor]:
        """Per-segment device views of the reduced gradient (device placement, or a twin's
        device part: ``segs`` inside it)."""
        src = self.device_shard if self.stage >= 2 else self.flat_grad
        src = src if self.accum is None else self.accum
        key = "flat_start" if self.stage <= 1 else "shard_start"
        segs = self.segs if segs is None else segs
        return [src[getattr(s, key) : getattr(s, key) + s.numel] for s in segs]

    def host_grad(self) -> torch.Tensor:
        """This step's host gradient (of the host part: index 0 is shard offset ``host_from``),
        after its copies have landed."""
        if self.d2h_done is not None:
            with label(GRAD_WAIT):
                self.d2h_done.synchronize()
        return self.host[self.host_index]

    def flip(self) -> None:
        """Delayed update: the next step's gradients go to the other host buffer."""
        self.host_index = (self.host_index + 1) % len(self.host)

    def zero(self) -> None:
        """Start a new accumulation window. The 16-bit device shard is not cleared (no pass over
        it): the next backward writes it instead of adding, even where it is not the window's
        first one (after a backward that raised part way, then ``zero_grad``)."""
        if self.flat_grad is not None:
            self.flat_grad.zero_()
        if self.accum is not None:
            self.accum.zero_()
        if self.device_shard is not None and self.accum_dtype != self.group.dtype:
            self.device_shard.zero_()  # another accumulator dtype is always added into
        self.zeroed = True
        self.carry = None
        self._sq.clear()

    def begin_backward(self, first: bool) -> None:
        """Before each backward: does it write the device shard's segments (the window's first
        backward, or the first since ``zero``) or add into them? Every segment is reduced once
        per completed backward (unused params as zeros), so a writing backward covers it all."""
        self.writes = first or self.zeroed
        self.zeroed = False
        if self.accum is not None:
            # Invariant: the 16-bit flat grad holds only this backward's gradient; the
            # earlier micro-steps' are in ``accum`` already (DeepSpeed clears lp grads here).
            self.flat_grad.zero_()

    def nbytes(self) -> dict[str, int]:
        out = {}
        if self.flat_grad is not None:
            out["device.grads"] = self.flat_grad.numel() * self.flat_grad.element_size()
        if self.accum is not None:
            out["device.grad_accum"] = self.accum.numel() * self.accum.element_size()
        if self.device_shard is not None:
            out["device.grad_shard"] = self.device_shard.numel() * self.device_shard.element_size()
        if self.host:
            out["host.grad_shard"] = sum(host_bytes(h) for h in self.host)
        return out
