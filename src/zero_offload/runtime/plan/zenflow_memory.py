"""ZenFlow's own buffers per rank (``zero_optimization.zenflow``, ``runtime/update/zenflow/``),
as ``ZenFlowRunner`` allocates them and ``memory_report()`` counts them:

- ``device.zenflow_columns``: per 2-D param of shape (rows, cols), the two Adam moments of its
  ``k`` selected columns (rows x k each) and the columns' int64 indices (k); per 1-D param, the
  two moments of the whole param. On one rank ``k = max(1, int(cols * topk_ratio))``; on several
  the sum of that count over the param's fragments in DeepSpeed's partitions (``columns.py``).
  The moments are in the params' dtype (fp16: fp32). They exist from the first device update on
  (after the warm-up rounds). Every rank holds all of them (the device part is replicated).
- ``device.zenflow_grad`` (several ranks): the buffers the ranks' pieces are all-reduced in
  (``step_grads.py``): per 2-D param its selected columns' gradient (rows x k, in the host
  gradient's dtype) and its column norms (cols, fp32), per 1-D param its whole gradient.
- ``host.zenflow_staging`` (several ranks): the host buffer the selected gradient is assembled
  in before its upload (pinned beside a GPU), the size of its part of ``device.zenflow_grad``.
- ``host.zenflow_accum``: the fp32 accumulator of the gradients between host updates, one per
  shard element; ``overlap_step``: two (one filled while the other is being applied).
- ``host.zenflow_overlap`` (``overlap_step``): the second set of host moments and the master's
  copy the params take one interval later, fp32, three per shard element.

Stage 3: the device part holds moments for the selected elements this rank's param shard holds
(an even share of every rank's: exact on one rank, the average on several, where the share
follows the selection), and their shard positions, int64, in host memory
(``host.zenflow_index``) and, beside a param shard on the device, again on the device (in
``device.zenflow_columns``; on a CPU it is host memory: one copy); ``device.zenflow_grad`` is the column norms only.

Nothing else: on one rank the device part reads the selected columns' gradient from the host
grad shard; it keeps no master columns between steps (its fp32 working copy lives for one param's update).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..update.zenflow.columns import (
    column_fragments,
    num_selected,
    selected_count,
    stage3_count,
)

INDEX_BYTES = 8  # the selected columns' indices: int64
POSITION_BYTES = 4  # stage 3: the held elements' shard positions, int32 (values.position_dtype)


@dataclass(frozen=True)
class ZenFlowPlan:
    """What ZenFlow's buffers are sized by."""

    topk_ratio: float
    overlap_step: bool
    moment_bytes: int  # the device moments' element size: the params' dtype, fp16's is fp32
    stage3: bool = False
    shard_on_device: bool = False  # stage 3 without offload_param: positions there too

    @classmethod
    def for_dtype(cls, topk_ratio: float, overlap_step: bool, dtype_bytes: int,
                  fp16: bool, stage3: bool = False,
                  shard_on_device: bool = False) -> ZenFlowPlan:  # fmt: skip
        moment = 4 if fp16 else dtype_bytes
        return cls(topk_ratio, overlap_step, moment, stage3, stage3 and shard_on_device)


def plan_from_config(config, world: int, device=None) -> ZenFlowPlan | None:
    """The plan of a validated config where the engine builds ZenFlow for it (the model's own
    refusals, a client optimizer or params of more dimensions, are not known here); ``device``:
    the engine's (None: an accelerator)."""
    import torch

    from ..update.zenflow.wiring import unbuilt

    zf = config.zero_optimization.zenflow
    muon = config.optimizer is not None and config.optimizer.muon
    if zf is None or unbuilt(config, world, muon) is not None:
        return None
    fp16 = config.dtype == torch.float16
    zc = config.zero_optimization
    # a device param shard apart from host memory (not a CPU run's "device")
    on_device = zc.offload_param_device in (None, "none") and getattr(device, "type", "") != "cpu"
    return ZenFlowPlan.for_dtype(zf.topk_ratio, zf.overlap_step, config.dtype.itemsize, fp16,
                                 zc.stage == 3, on_device)  # fmt: skip


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
    if plan.stage3:
        return _stage3_bytes(shapes, shard, plan, world, grad_bytes)
    frags = column_fragments(shapes, world) if world > 1 else [None] * len(shapes)
    device = parts = norms = 0
    for shape, fr in zip(shapes, frags):
        if len(shape) == 2:
            k = num_selected(shape[1], plan.topk_ratio) if fr is None else None
            k = selected_count(fr, plan.topk_ratio) if k is None else k
            device += 2 * shape[0] * k * plan.moment_bytes + k * INDEX_BYTES
            parts += shape[0] * k
            norms += shape[1]
        else:
            n = 1
            for d in shape:
                n *= d
            device += 2 * n * plan.moment_bytes
            parts += n
    out = {"device.zenflow_columns": device}
    if world > 1:  # the selected columns' and 1-D params' gradient, and the column norms
        out["device.zenflow_grad"] = parts * grad_bytes + norms * 4  # the norms in fp32
        out["host.zenflow_staging"] = parts * grad_bytes  # where the parts are assembled
    return _host_terms(out, shard, plan)


def _host_terms(out: dict[str, int], shard: int, plan: ZenFlowPlan) -> dict[str, int]:
    out["host.zenflow_accum"] = shard * 4 * (2 if plan.overlap_step else 1)
    if plan.overlap_step:
        out["host.zenflow_overlap"] = shard * 4 * 3
    return out


def _stage3_bytes(
    shapes: list[tuple[int, ...]], shard: int, plan: ZenFlowPlan, world: int, grad_bytes: int
) -> dict[str, int]:
    """Stage 3: per rank an even share of the device part's elements (``values.py``)."""
    held = cols = ncols = 0  # device-part elements; selected columns; column norms
    for shape in shapes:
        n = 1
        for d in shape:
            n *= d
        if len(shape) == 2 and shape[0] > 1:
            k = stage3_count(shape, world, plan.topk_ratio)
            held += -(-shape[0] * k // world)
            cols += k
            ncols += shape[1]
        else:  # updated whole
            held += -(-n // world)
    pos = POSITION_BYTES if shard < 2**31 else INDEX_BYTES
    device = 2 * held * plan.moment_bytes + cols * INDEX_BYTES
    if plan.shard_on_device:
        device += held * pos
    out = {"device.zenflow_columns": device, "host.zenflow_index": held * pos}
    if world > 1:
        out["device.zenflow_grad"] = ncols * 4  # fp32
    return _host_terms(out, shard, plan)
