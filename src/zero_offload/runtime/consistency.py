"""Start-up agreement between ranks: the same config, the same parameter shapes, the same weights.

Data parallelism is only a reformulation of single-process training if every rank starts from
the same weights and builds the same layout. Ranks seeded differently would otherwise train
different models at stage 0 and a silent mix of both at stages 1-2; ranks with different bucket
sizes or shapes would issue collectives of different sizes, which gloo reports only as "Received
data size doesn't match". So, before the engine flattens or partitions anything:

1. every rank gathers every rank's fingerprint (config keys that shape the collectives, and the
   name, shape and dtype of each param and buffer) and compares it with rank 0's; a mismatch is
   one error, raised identically on every rank, naming the key and the ranks that differ;
2. rank 0's params and buffers are broadcast to the others (DeepSpeed's start-up broadcast).
   It runs on the module's own tensors before the engine builds flat buffers or partitions, so
   every later layout (stage 3's too) starts from rank 0's values.
"""

from __future__ import annotations

from typing import Any

import torch

from . import dist


class RankMismatchError(RuntimeError):
    """Ranks were started with different configs or models."""


def _config_fingerprint(config) -> dict[str, Any]:
    zc = config.zero_optimization
    oc = zc.offload_optimizer
    return {
        "zero_optimization.stage": zc.stage,
        "dtype": str(config.dtype),
        "zero_optimization.reduce_bucket_size": int(zc.reduce_bucket_size),
        "zero_optimization.allgather_bucket_size": int(zc.allgather_bucket_size),
        "zero_optimization.offload_optimizer.device": zc.offload_device,
        "zero_optimization.offload_optimizer.delayed_update": bool(oc and oc.delayed_update),
        "gradient_accumulation_steps": config.gradient_accumulation_steps,
        "train_micro_batch_size_per_gpu": config.train_micro_batch_size_per_gpu,
        "train_batch_size": config.train_batch_size,
        "gradient_clipping": float(config.gradient_clipping),
        "fp16.enabled": bool(config.fp16.enabled),
        "bf16.enabled": bool(config.bf16.enabled),
        "zero_optimization.offload_param.device": zc.offload_param_device,
        "zero_optimization.stage3_prefetch_bucket_size": int(zc.stage3_prefetch_bucket_size),
        "zero_optimization.stage3_param_persistence_threshold": int(
            zc.stage3_param_persistence_threshold
        ),
        "zero_optimization.stage3_max_live_parameters": int(zc.stage3_max_live_parameters),
    }


def fingerprint(module: torch.nn.Module, config) -> dict[str, Any]:
    """What every rank must agree on: collective-shaping config keys and the module's tensors."""
    out = _config_fingerprint(config)
    for kind, items in (("param", module.named_parameters()), ("buffer", module.named_buffers())):
        for name, t in items:  # a zero.Init param's shape is its ds_shape
            out[f"{kind} {name}"] = (tuple(getattr(t, "ds_shape", t.shape)), str(t.dtype))
    return out


def _mismatches(prints: list[dict[str, Any]]) -> list[str]:
    """One line per key on which some rank differs from rank 0."""
    lines = []
    keys = list(prints[0]) + [k for p in prints[1:] for k in p if k not in prints[0]]
    for key in dict.fromkeys(keys):
        ref = prints[0].get(key, "<absent>")
        bad = [r for r, p in enumerate(prints) if p.get(key, "<absent>") != ref]
        if bad:
            values = ", ".join(f"rank {r}: {prints[r].get(key, '<absent>')!r}" for r in bad)
            lines.append(f"{key}: rank 0 has {ref!r}; {values}")
    return lines


def check_agreement(module: torch.nn.Module, config) -> None:
    """Raise RankMismatchError on every rank when any rank's fingerprint differs from rank 0's."""
    if dist.world_size() == 1:
        return
    mine = fingerprint(module, config)
    prints: list[Any] = [None] * dist.world_size()
    dist.all_gather_object(prints, mine)
    lines = _mismatches(prints)
    if lines:
        shown = lines[:10] + ([f"... and {len(lines) - 10} more"] if len(lines) > 10 else [])
        raise RankMismatchError(
            "ranks disagree on the config or the model (every rank must run the same config "
            "and build the same model):\n  " + "\n  ".join(shown)
        )


@torch.no_grad()
def broadcast_module(module: torch.nn.Module) -> None:
    """Overwrite every param and buffer with rank 0's values (in place, so views stay views)."""
    if dist.world_size() == 1:
        return
    seen: set[int] = set()
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) in seen or hasattr(t, "_z3_init"):  # tied: one tensor; zero.Init: rank 0's
            continue
        seen.add(id(t))
        comm = dist.default_device()
        if t.device != comm:  # stage 3 partitions params from where they are (NCCL: on the GPU)
            tmp = t.data.to(comm)
            dist.broadcast(tmp, src=0)
            t.data.copy_(tmp)
        elif t.data.is_contiguous():
            dist.broadcast(t.data, src=0)
        else:
            tmp = t.data.contiguous()
            dist.broadcast(tmp, src=0)
            t.data.copy_(tmp)


def synchronize_start(module: torch.nn.Module, config) -> None:
    """Check that all ranks agree, then give every rank rank 0's weights. A collective."""
    check_agreement(module, config)
    broadcast_module(module)
