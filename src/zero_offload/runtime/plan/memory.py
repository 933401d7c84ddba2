"""Model-state memory arithmetic: what each rank should hold, per category.

For ``numel`` params (padded to the layout), training dtype of ``b`` bytes, Adam (fp32 master,
exp_avg, exp_avg_sq: 12 bytes), N ranks; "offload" is ``offload_optimizer``:

| stage             | device                                  | host                              |
| 0                 | params b + grads b + 12                 | 0                                 |
| 1                 | params b + grads b + 12/N               | 0                                 |
| 2                 | params b + grad shard b/N + 12/N        | 0                                 |
| 1/2 + offload     | params b (+ stage 1 grads b)            | 12/N + grad b/N + staging b/N     |
| 3                 | param shard b/N + grad shard b/N + 12/N | 0                                 |
| 3 + offload       | param shard b/N                         | 12/N + grad b/N + staging b/N     |
| 3 + offload_param | grad shard b/N + 12/N                   | param shard b/N                   |
| 3 + both offloads | 0                                       | param shard b/N + 12/N + grad b/N |

Partial offload (stage 3, ``offload_optimizer.ratio`` r < 1): the optimizer columns split, the
device part ``(1 - r)`` of the shard (rounded as ``placement.twin_split`` cuts it) keeps its
12 bytes, its grad shard (b) and no staging on the device; the host part keeps the rest.

fp32 training with the optimizer and the params on the device keeps no master copy: the fp32
params (stage 3: the param shard) are the master, so the 12 becomes 8 (the moments).

Compact states (``state``, ``core/state/format.py``): the 12 is the master's bytes (fp32 4,
``bf16.bf16_master_weights_and_grads`` 2) plus both moments' (fp32 8, ``bf16_optimizer_states``
4, ``Adam8bit``/``AdamW8bit`` 2 + 8/block of scales), ``state_bytes.py``. A bf16 master is the
bf16 params' own dtype: it is aliased where fp32 training's master is (the params are the
master), and with offload the host update writes it as the 16-bit param, so there is no
staging buffer. Stage 2 + offload with bf16 training: host 16 bytes/param with fp32 states
(master 4, moments 8, grad 2, staging 2), 8 with bf16 states (2 + 4 + 2), 6 + 8/block with
8-bit moments and a bf16 master (2 + 2 + 8/block + 2).

Muon (stages 0-3, the state on the device or, with offload, on the host): its groups keep one
momentum buffer instead of Adam's two moments, so their 12 becomes 8 (fp32 on the device: 4);
the aux AdamW group is an Adam group.

Stages 2 and 3 also hold grad bucket buffers (at most ``reduce_bucket_size`` each, two kept for
the run; none on one rank whose grad shard is on the device, where the hooks fill it directly),
which are not part of the formula; with offload and gradient accumulation the grad
shard is accumulated on the device (b/N) and only the final sum crosses the bus; the delayed update
keeps two host grad shards. fp32 training needs no staging buffer (the master uploads itself).
The grad shards (device accumulator and host copy, not the stage 0/1 grads) take ``a`` bytes
per element instead of ``b`` when ``data_types.grad_accum_dtype`` differs from the training dtype
(fp32 with 16-bit params: ``a`` = 4). At stages 0/1 such an accumulator is one more full-length
flat buffer (``device.grad_accum``, ``a`` bytes per param) beside the 16-bit grads.

Stage 3 keeps no full-size params or grads: each rank holds its param shard (b/N), on the host
with ``offload_param``, and the gathered (live) params of the modules running now, bounded by
``stage3_max_live_parameters`` and, like grad buckets, not part of the formula. With both offloads
the host update writes the 16-bit param shard in place, so there is no staging buffer.
"""

from __future__ import annotations

import torch

from ...core.state.format import FP32, StateFormat
from ..update.placement import twin_split
from .state_bytes import master_bytes, moment_bytes


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _check_placement(stage: int, offload: bool, offload_param: bool) -> None:
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage}")
    if offload_param and stage != 3:
        raise ValueError(f"offload_param needs stage 3, got stage {stage}")
    if offload and stage == 0:
        raise ValueError("offload needs stage 1, 2 or 3, got stage 0")


def expected_bytes(
    numel: int,
    dtype: torch.dtype,
    stage: int,
    world_size: int,
    offload: bool,
    gas: int = 1,
    delayed: bool = False,
    *,
    offload_param: bool = False,
    ratio: float = 1.0,
    accum_dtype: torch.dtype | None = None,
    alias_master: bool | None = None,
    muon_numel: int = 0,
    state: StateFormat = FP32,
) -> dict[str, int]:
    """Model-state bytes per rank by category (``device.*`` / ``host.*``). ``offload`` is
    optimizer offload; ``offload_param`` (stage 3 only) puts the 16-bit param shard on the host;
    ``ratio`` (stage 3 with offload) is the host's share of the optimizer state;
    ``accum_dtype`` is the grad shards' dtype (None: ``dtype``).
    ``alias_master``: the fp32 params are the master shard (no ``master_shard`` bytes); default:
    fp32 with the optimizer and the params in one memory (``core/state/alias_state.py``): both on the
    device, or at stage 3 both in host memory (whole offload, no delayed update; the offloads
    here are "cpu": a caller with NVMe passes False).
    ``muon_numel``: the part of ``numel`` in Muon groups (state: a momentum, 4 bytes, where
    the optimizer state is).
    ``state``: the optimizer state's format (``core/state/format.py``): the master's and the
    moments' bytes (``state_bytes.py``); a master of the params' dtype is aliased by the same
    rule as fp32 training's, and needs no 16-bit staging (the host update writes it)."""
    _check_placement(stage, offload, offload_param)
    if muon_numel and state.compact:
        raise ValueError("Muon keeps fp32 state: muon_numel needs the fp32 state format")
    b = dtype_bytes(dtype)
    a = b if accum_dtype is None else dtype_bytes(accum_dtype)  # grad shards, device and host
    shard = numel if stage == 0 else numel // world_size
    # the device part of the optimizer state: all of it, none (offload) or a twin's cut
    cut = shard if not offload else twin_split(shard, ratio) if stage == 3 else 0
    out = _params_and_grads(numel, shard, cut, b, a, stage, offload, offload_param, gas)
    if alias_master is None:
        alias_master = b == state.master_bytes and _beside(
            stage, offload, offload_param, cut, delayed
        )
    home = "host" if offload_param else "device"
    for where, n in (("device", cut), ("host", shard - cut)):
        if n or where == ("host" if offload else "device"):
            if not (alias_master and where == home):  # the params are the master themselves
                out[f"{where}.master_shard"] = master_bytes(n, state)
            # Muon (never split by a twin): its state is wherever the whole optimizer's is
            held = where == ("host" if offload else "device")
            muon = muon_numel // (1 if stage == 0 else world_size) * held
            out[f"{where}.optimizer_state"] = moment_bytes(n, state) - muon * 4
    if offload:
        out["host.grad_shard"] = (shard - cut) * a * (2 if delayed else 1)
        if b < state.master_bytes and not offload_param:  # a master wider than the params
            out["host.param_staging"] = (shard - cut) * b
    return out


def _params_and_grads(numel, shard, cut, b, a, stage, offload, offload_param, gas) -> dict:
    """The 16-bit params' and the device gradients' bytes (``b``: the params' element size,
    ``a``: the grad shards')."""
    out: dict[str, int] = {}
    if stage == 3:
        out[f"{'host' if offload_param else 'device'}.param_shard"] = shard * b
    else:
        out["device.params"] = numel * b
    if stage <= 1:
        out["device.grads"] = numel * b
        if a != b:  # the full-length flat accumulator beside the 16-bit grads
            out["device.grad_accum"] = numel * a
    elif not offload or gas > 1:
        out["device.grad_shard"] = shard * a
    elif cut:
        out["device.grad_shard"] = cut * a
    return out


def _beside(stage: int, offload: bool, offload_param: bool, cut: int, delayed: bool) -> bool:
    """The optimizer state sits beside the params in one memory ("cpu" offloads): both on the
    device, or at stage 3 both in host memory, whole, without the delayed update."""
    if not offload:
        return not offload_param
    return stage == 3 and offload_param and cut == 0 and not delayed


# (stage, offload, offload_param) rows of the estimate table.
TABLE_CASES = (
    (0, False, False),
    (1, False, False),
    (1, True, False),
    (2, False, False),
    (2, True, False),
    (3, False, False),
    (3, True, False),
    (3, False, True),
    (3, True, True),
)


def per_param_table(
    numel: int,
    world_size: int,
    dtype: torch.dtype = torch.float16,
    ratio: float = 1.0,
    muon_share: float = 0.0,
    state: StateFormat = FP32,
) -> list[dict]:
    """Every stage with and without offload (and, at stage 3, parameter offload), for
    ``zero-offload estimate``; ``ratio``: the stage-3 offload rows' partial offload;
    ``muon_share``: the params' share in a Muon group (then no partial-offload rows);
    ``state``: the optimizer state's format."""
    rows = []
    muon = round(numel * muon_share)
    for stage, offload, offload_param in TABLE_CASES:
        r = ratio if stage == 3 else 1.0
        if muon and offload and r < 1.0:
            continue  # Muon has no partial offload
        e = expected_bytes(numel, dtype, stage, world_size, offload, offload_param=offload_param,
                           ratio=r, muon_numel=muon, state=state)  # fmt: skip
        dev = sum(v for k, v in e.items() if k.startswith("device."))
        host = sum(v for k, v in e.items() if k.startswith("host."))
        rows.append(
            {
                "stage": stage,
                "offload": offload,
                "ratio": r if offload else 1.0,
                "offload_param": offload_param,
                "device": dev,
                "host": host,
                "optimizer_state": e.get("device.optimizer_state", 0)
                + e.get("device.master_shard", 0)
                + e.get("host.optimizer_state", 0)
                + e.get("host.master_shard", 0),
            }
        )
    return rows
