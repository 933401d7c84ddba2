"""Placement "device": master, exp_avg and exp_avg_sq on the accelerator; the update is torch's
fused Adam(W) over this rank's segments (or another rule over the master), and the whole shard
is written to the param home in one call. A twin's device part (twin_update.py) runs the two
halves apart: ``compute`` (kernels queued, asynchronous on CUDA), then ``write_home``.

A compact state format (bf16 master, bf16 or 8-bit moments, ``core/state/format.py``) runs the
host kernel's arithmetic written in PyTorch (``kernels/adam_states.reference_adam_step_states``)
instead of the fused kernel: torch's fused Adam over bf16 tensors computes in fp32 too, but with
its own operation order (``lerp`` for the first moment), so its bf16 values part from the host
kernel's by a bf16 ulp here and there and drift apart over steps; stochastic rounding and 8-bit
moments have no fused kernel at all. That update runs chunk by chunk over the whole shard range
(the host update's chunks, multiples of ``CHUNK_ALIGN``, so every 8-bit block lies in one
chunk), not segment by segment: a segment's end is not on a block boundary, and a block cut in
two would be quantized as two. The padding between segments is in the shard range too: its
gradient, master and moments are zero and stay zero, as in the host update."""

from __future__ import annotations

import bisect

import torch

from ....kernels.adam_states import as_cpu_adam_hyper, reference_adam_step_states
from ..shard_optimizer import ShardOptimizer


class DeviceUpdate(ShardOptimizer):
    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        # The update, chosen once: torch's fused Adam(W) over fp32 states, or the compact
        # states' reference arithmetic chunk by chunk.
        self._update = self._adam_states if self.placement.state.compact else self._adam
        self._starts = [s.shard_start for s in self.segs]  # in shard order (_grad_range)

    def adam(self, factor: float, commit: bool = True) -> None:
        self.compute(factor)
        self.write_home()

    def compute(self, factor: float) -> None:
        """Adam's update of the master and moments (queued on the current stream with CUDA)."""
        if self.segs:  # a twin's device part may be empty
            self._update(factor)

    def grad_views(self) -> list[torch.Tensor]:
        return self._grads()

    def write_home(self) -> None:
        if not self.aliased:  # an aliased master was updated in the home itself
            self.home.write(0, self.master)  # the master covers the whole shard (span)

    def _grads(self) -> list[torch.Tensor]:
        """The reduced gradient of each segment. A span is a twin's device part, which starts
        at shard offset 0: its coordinates are the grad shard's."""
        assert self.span.lo == 0, "a device part starts at the shard's beginning"
        return self.grads.device_grads(self.segs)

    def _adam(self, factor: float) -> None:
        h = self._hyper()
        grads = [g if g.dtype == torch.float32 else g.float() for g in self._grads()]
        torch._foreach_mul_(grads, factor)  # fp32 grads are this rank's own, consumed here
        views = lambda t: [t[s.shard_start : s.shard_start + s.numel] for s in self.segs]  # noqa: E731
        p = self.state.views("master", self.segs) if self.aliased else views(self.master)
        m, v = views(self.state.exp_avg), views(self.state.exp_avg_sq)
        if not self.group.hyper.get("bias_correction", True):
            _adam_no_bias_correction(p, grads, m, v, self.adamw, **h)
            return
        # One step tensor filled on the device, shared by every segment (the fused kernel only
        # reads it): no host-to-device copy per segment per step.
        step = torch.full((), float(self.step_count), device=self.state.exp_avg.device)
        fused = torch._fused_adamw_ if self.adamw else torch._fused_adam_
        fused(
            p,
            grads,
            m,
            v,
            [],
            [step] * len(p),
            lr=h["lr"],
            beta1=h["beta1"],
            beta2=h["beta2"],
            weight_decay=h["weight_decay"],
            eps=h["eps"],
            amsgrad=False,
            maximize=False,
        )

    def _adam_states(self, factor: float) -> None:
        """Compact states: the reference update over each chunk of the shard range, in place
        (an aliased master's chunk that no view covers goes back through the home)."""
        # DeepSpeed's fp32 hyperparameters, as the host update of a compact format takes them
        h, step = as_cpu_adam_hyper(self._hyper()), self.step_count
        bc = bool(self.group.hyper.get("bias_correction", True))
        grads = self._grads()

        def body(lo: int, hi: int, v: dict) -> None:
            reference_adam_step_states(
                v["master"], v["exp_avg"], v["exp_avg_sq"], self._grad_range(grads, lo, hi),
                None, step=step, adamw=self.adamw, bias_correction=bc, grad_scale=factor,
                **self._state_options(lo, step), **h,
            )  # fmt: skip

        self.state.update(self.chunks, body)

    def _grad_range(self, grads: list[torch.Tensor], lo: int, hi: int) -> torch.Tensor:
        """The reduced gradient of shard range ``[lo, hi)`` (the segments tile the shard, each
        with its padding): a view where one segment covers it, else its pieces joined."""
        pieces = []
        # the segments are in shard order: start at the one holding ``lo`` (no scan of every
        # segment for every chunk)
        for i in range(max(0, bisect.bisect_right(self._starts, lo) - 1), len(self.segs)):
            s, g = self.segs[i], grads[i]
            if s.shard_start >= hi:
                break
            a, b = max(lo, s.shard_start), min(hi, s.shard_start + s.numel)
            if a < b:
                pieces.append(g[a - s.shard_start : b - s.shard_start])
        assert sum(p.numel() for p in pieces) == hi - lo, "the segments tile the shard"
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _adam_no_bias_correction(p, g, m, v, adamw, lr, beta1, beta2, eps, weight_decay) -> None:
    """Adam(W) without bias correction (DeepSpeed's ``bias_correction: false``)."""
    if weight_decay and adamw:
        torch._foreach_mul_(p, 1.0 - lr * weight_decay)
    elif weight_decay:
        g = torch._foreach_add(g, p, alpha=weight_decay)
    torch._foreach_lerp_(m, g, 1.0 - beta1)
    torch._foreach_mul_(v, beta2)
    torch._foreach_addcmul_(v, g, g, value=1.0 - beta2)
    denom = torch._foreach_add(torch._foreach_sqrt(v), eps)
    torch._foreach_addcdiv_(p, m, denom, value=-lr)
