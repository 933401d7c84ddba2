"""What made a step's gradient norm overflow, for the skipped-step report.

The norm is summed in float32, so it is not finite when an element is inf/NaN *or* when a finite
element is too large to square (|g| above about 1.8e19): both skip the step, and the report must
say which was found. Only a skipped step pays for this pass over the reduced gradients; every
rank takes part (at stage >= 1 each holds a share), which is safe because every rank agrees the
step overflowed."""

from __future__ import annotations

import torch

from ...core import dist
from ..reduce.grad_shard import GradShard


def _held_gradients(gs: GradShard) -> list[torch.Tensor]:
    """This step's reduced gradient as this rank holds it: the device part, the host part."""
    out: list[torch.Tensor] = []
    if gs.stage <= 1 or gs.device_shard is not None:
        out += gs.device_grads()
    if gs.host:
        out.append(gs.host_grad())
    return out


def overflow_cause(grad_shards: list[GradShard], scale: float, reduce: bool) -> str:
    """Words for the report: ``inf/NaN`` found, or the largest finite element that overflowed
    the squared norm (unscaled by ``scale``). ``reduce``: combine the ranks' findings."""
    nonfinite, amax = 0.0, 0.0
    for gs in grad_shards:
        for t in _held_gradients(gs):
            if t.numel() == 0:
                continue
            finite = torch.isfinite(t)
            nonfinite += float((~finite).sum())
            amax = max(amax, float(t.abs().masked_fill(~finite, 0).max()))
    if reduce and dist.world_size() > 1:
        found: list = [None] * dist.world_size()
        dist.all_gather_object(found, (nonfinite, amax))
        nonfinite, amax = max(f[0] for f in found), max(f[1] for f in found)
    if nonfinite:
        return "gradients are not finite (inf/NaN)"
    if amax:
        return (
            f"the gradient norm overflows float32: every gradient element is finite, the "
            f"largest |g| is {amax / scale:.3g} (its square passes float32's 3.4e38)"
        )
    return "the gradient norm is not finite"
