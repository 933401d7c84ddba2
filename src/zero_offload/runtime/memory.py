"""Model-state memory arithmetic: what each rank should hold, per category.

For ``numel`` params (padded to the layout), training dtype of ``b`` bytes, Adam (fp32 master,
exp_avg, exp_avg_sq: 12 bytes), N ranks:

| stage          | device                                   | host                        |
| 0              | params b + grads b + 12                  | 0                           |
| 1              | params b + grads b + 12/N                | 0                           |
| 2              | params b + grad shard b/N + 12/N         | 0                           |
| 1/2 + offload  | params b (+ stage 1 grads b)             | 12/N + grad b/N + staging b/N |

Stage 2 also holds grad bucket buffers (``reduce_bucket_size`` each, at most two alternating with
overlap_comm), which are not part of the formula; with offload and gradient accumulation the grad
shard is accumulated on the device (b/N) and only the final sum crosses the bus; the delayed update
keeps two host grad shards. fp32 training needs no staging buffer (the master uploads itself).
"""

from __future__ import annotations

import torch


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def expected_bytes(
    numel: int,
    dtype: torch.dtype,
    stage: int,
    world_size: int,
    offload: bool,
    gas: int = 1,
    delayed: bool = False,
    offload_param: bool = False,
) -> dict[str, int]:
    b = dtype_bytes(dtype)
    shard = numel if stage == 0 else numel // world_size
    out = {"device.params": numel * b}
    if stage <= 1:
        out["device.grads"] = numel * b
    elif not offload or gas > 1:
        out["device.grad_shard"] = shard * b
    where = "host" if offload else "device"
    out[f"{where}.master_shard"] = shard * 4
    out[f"{where}.optimizer_state"] = shard * 8
    if offload:
        out["host.grad_shard"] = shard * b * (2 if delayed else 1)
        if b < 4:
            out["host.param_staging"] = shard * b
    return out


def per_param_table(numel: int, world_size: int, dtype: torch.dtype = torch.float16) -> list[dict]:
    """Every stage with and without offload, for ``zero-offload estimate``."""
    rows = []
    for stage in (0, 1, 2):
        for offload in (False, True):
            if offload and stage == 0:
                continue
            e = expected_bytes(numel, dtype, stage, world_size, offload)
            dev = sum(v for k, v in e.items() if k.startswith("device."))
            host = sum(v for k, v in e.items() if k.startswith("host."))
            rows.append(
                {
                    "stage": stage,
                    "offload": offload,
                    "device": dev,
                    "host": host,
                    "optimizer_state": e.get("device.optimizer_state", 0)
                    + e.get("device.master_shard", 0)
                    + e.get("host.optimizer_state", 0)
                    + e.get("host.master_shard", 0),
                }
            )
    return rows
