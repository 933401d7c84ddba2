"""ZenFlow's own buffers per rank (``zero_optimization.zenflow``, ``runtime/update/zenflow/``),
as ``ZenFlowUpdate`` allocates them and ``memory_report()`` counts them:

- ``device.zenflow_columns``: per 2-D param of shape (rows, cols), the two Adam moments of its
  ``k`` selected columns (rows x k each) and the columns' int64 indices (k); per 1-D param, the
  two moments of the whole param. On one rank ``k = max(1, int(cols * topk_ratio))``; on several
  the sum of that count over the param's fragments in DeepSpeed's partitions (``columns.py``).
  The moments are in the params' dtype (fp16: fp32). They exist from the first device update on
  (after the warm-up rounds). Every rank holds all of them (the device part is replicated).
- ``device.zenflow_grad`` (several ranks): the buffers the ranks' pieces are all-reduced in
  (``step_grads.py``), in the host gradient's dtype: per 2-D param its selected columns'
  gradient (rows x k) and its column norms (cols), per 1-D param its whole gradient.
- ``host.zenflow_accum``: the fp32 accumulator of the gradients between host updates, one per
  shard element; ``overlap_step``: two (one filled while the other is being applied).
- ``host.zenflow_overlap`` (``overlap_step``): the second set of host moments and the master's
  copy the params take one interval later, fp32, three per shard element.

Nothing else: on one rank the device part reads the selected columns' gradient from the host
grad shard; it keeps no master columns between steps (its fp32 working copy lives for one param's update).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..update.zenflow.columns import column_fragments, num_selected, selected_count

INDEX_BYTES = 8  # the selected columns' indices: int64


@dataclass(frozen=True)
class ZenFlowPlan:
    """What ZenFlow's buffers are sized by."""

    topk_ratio: float
    overlap_step: bool
    moment_bytes: int  # the device moments' element size: the params' dtype, fp16's is fp32

    @classmethod
    def for_dtype(cls, topk_ratio: float, overlap_step: bool, dtype_bytes: int,
                  fp16: bool) -> ZenFlowPlan:  # fmt: skip
        return cls(topk_ratio, overlap_step, 4 if fp16 else dtype_bytes)


def plan_from_config(config, world: int) -> ZenFlowPlan | None:
    """The plan of a validated config where the engine builds ZenFlow for it (the model's own
    refusals, a client optimizer or params of more dimensions, are not known here)."""
    import torch

    from ..update.zenflow.wiring import unbuilt

    zf = config.zero_optimization.zenflow
    muon = config.optimizer is not None and config.optimizer.muon
    if zf is None or unbuilt(config, world, muon) is not None:
        return None
    fp16 = config.dtype == torch.float16
    return ZenFlowPlan.for_dtype(zf.topk_ratio, zf.overlap_step, config.dtype.itemsize, fp16)


def zenflow_bytes(
    shapes: Iterable[tuple[int, ...]],
    shard: int,
    plan: ZenFlowPlan,
    world: int = 1,
    grad_bytes: int = 4,
) -> dict[str, int]:
    """ZenFlow's bytes by memory-report category, for params of ``shapes`` (1-D or 2-D, in
    registration order: it places DeepSpeed's partition cuts) and a shard of ``shard`` elements
    (the padded flat group on one rank) on each of ``world`` ranks; ``grad_bytes``: the host
    gradient's element size."""
    shapes = [tuple(s) for s in shapes]
    frags = column_fragments(shapes, world) if world > 1 else [None] * len(shapes)
    device = reduced = 0
    for shape, fr in zip(shapes, frags):
        if len(shape) == 2:
            k = num_selected(shape[1], plan.topk_ratio) if fr is None else None
            k = selected_count(fr, plan.topk_ratio) if k is None else k
            device += 2 * shape[0] * k * plan.moment_bytes + k * INDEX_BYTES
            reduced += shape[0] * k + shape[1]
        else:
            n = 1
            for d in shape:
                n *= d
            device += 2 * n * plan.moment_bytes
            reduced += n
    out = {
        "device.zenflow_columns": device,
        "host.zenflow_accum": shard * 4 * (2 if plan.overlap_step else 1),
    }
    if world > 1:  # the selected columns' and 1-D params' gradient, and the column norms
        out["device.zenflow_grad"] = reduced * grad_bytes
    if plan.overlap_step:
        out["host.zenflow_overlap"] = shard * 4 * 3
    return out
