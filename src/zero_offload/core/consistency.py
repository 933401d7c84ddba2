"""Start-up agreement between ranks: the same config, the same parameter shapes, the same weights.

Data parallelism is only a reformulation of single-process training if every rank starts from
the same weights and builds the same layout. Ranks seeded differently would otherwise train
different models at stage 0 and a silent mix of both at stages 1-2; ranks with different bucket
sizes or shapes would issue collectives of different sizes, which gloo reports only as "Received
data size doesn't match". So, before the engine flattens or partitions anything:

1. every rank gathers every rank's fingerprint (every resolved config key but the few that are
   rank-local by nature, the ZeRO-3 leaf modules, and the name, shape and dtype of each param and
   buffer) and compares it with rank 0's; a mismatch is one error, raised identically on every
   rank, naming the key and the ranks that differ. The config is compared whole rather than by
   a hand-made list of "collective-shaping" keys: nearly every key changes which collectives run
   or when (bucket sizes, reuse distance, persistence, save gathers, tag validation, the
   overflow stop) or what the update does (ranks stepping with different lr silently train
   different shards), and a key added later is covered without anyone remembering to list it;
2. rank 0's params and buffers are broadcast to the others (DeepSpeed's start-up broadcast).
   It runs on the module's own tensors before the engine builds flat buffers or partitions, so
   every later layout (stage 3's too) starts from rank 0's values.
"""

from __future__ import annotations

from typing import Any

import torch

from . import dist, partitioned


class RankMismatchError(RuntimeError):
    """Ranks were started with different configs or models."""


# Keys that may differ between ranks: no collective, and no update, depends on them.
RANK_LOCAL = frozenset(
    {
        "steps_per_print",  # rank 0 logs
        "wall_clock_breakdown",
        "seed",  # weights come from rank 0; per-rank dropout streams are the user's choice
        "zero_optimization.offload_optimizer.threads",  # the host kernel's own pool
        "zero_optimization.offload_optimizer.pin_memory",
        "zero_optimization.offload_param.pin_memory",
        "zero_optimization.offload_optimizer.nvme_path",  # a per-rank local path
        "zero_optimization.offload_param.nvme_path",
    }
)


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(v, f"{prefix}.{k}" if prefix else k, out)
    else:
        out[prefix] = value


def _config_fingerprint(config) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    _flatten(config.to_dict(), "", flat)
    return {k: v for k, v in flat.items() if k not in RANK_LOCAL}


def fingerprint(module: torch.nn.Module, config) -> dict[str, Any]:
    """What every rank must agree on: the config (but rank-local keys), the ZeRO-3 leaf
    modules and the module's tensors."""
    out = _config_fingerprint(config)
    out["zero-3 leaf modules"] = [
        n for n, m in module.named_modules() if partitioned.is_leaf_module(m)
    ]
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
        if (
            id(t) in seen or partitioned.init_shard(t) is not None
        ):  # tied: one tensor; zero.Init: rank 0's
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
