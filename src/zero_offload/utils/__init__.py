"""DeepSpeed's ``safe_get_full_*`` helpers: the full (unpartitioned) view of one parameter's
gradient, fp32 master weight or optimizer state, gathered from every rank's shard.

Collective: every rank must call them, in the same order. The gradient is the averaged,
unscaled, unclipped gradient of the current accumulation window: call after the boundary
``backward`` and before ``step``.
"""

from __future__ import annotations

import torch

from ..checkpoint.export import get_fp32_state_dict_from_zero_checkpoint  # noqa: F401 (DeepSpeed's name)
from ..runtime import dist


def _owner(param: torch.Tensor):
    ref = getattr(param, "_zero_offload", None)
    engine = ref[0]() if ref else None
    if engine is None:
        raise ValueError("parameter is not managed by a live zero_offload engine")
    return engine, ref[1], ref[2]


def _gather_full(engine, gi: int, pieces: list[torch.Tensor]) -> torch.Tensor:
    """Full flat fp32 tensor from this rank's per-bucket pieces (stage 0: pieces are whole)."""
    g = engine.groups[gi]
    full = torch.zeros(g.layout.total, dtype=torch.float32, device=g.device)
    for b, piece in zip(g.layout.buckets, pieces):
        piece = piece.to(device=g.device, dtype=torch.float32)
        if engine.stage == 0:
            full[b.start : b.start + b.numel].copy_(piece)
        else:
            dist.all_gather(full[b.start : b.start + b.numel], piece)
    return full


def _param_slice(engine, gi: int, i: int, full: torch.Tensor) -> torch.Tensor:
    g = engine.groups[gi]
    off, n, p = g.layout.offsets[i], g.layout.numels[i], g.params[i]
    return full[off : off + n].view(getattr(p, "ds_shape", p.shape)).clone()


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor:
    engine, gi, i = _owner(param)
    gs = engine.grad_shards[gi]
    if engine.offload:
        host = gs.host_grad()
        pieces = [host[s.shard_start : s.shard_start + s.numel] for s in gs.segs]
    else:
        pieces = gs.device_grads()
    full = _gather_full(engine, gi, pieces) / engine.loss_scale
    return _param_slice(engine, gi, i, full)


def _shard_pieces(engine, gi: int, t: torch.Tensor) -> list[torch.Tensor]:
    return [t[s.shard_start : s.shard_start + s.numel] for s in engine.shard_opts[gi].segs]


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor:
    engine, gi, i = _owner(param)
    so = engine.shard_opts[gi]
    return _param_slice(
        engine, gi, i, _gather_full(engine, gi, _shard_pieces(engine, gi, so.master))
    )


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor:
    engine, gi, i = _owner(param)
    so = engine.shard_opts[gi]
    states = {"exp_avg": so.exp_avg, "exp_avg_sq": so.exp_avg_sq}
    if optim_state_key not in states:
        raise ValueError(
            f"optim_state_key must be one of {sorted(states)}, got {optim_state_key!r}"
        )
    return _param_slice(
        engine, gi, i, _gather_full(engine, gi, _shard_pieces(engine, gi, states[optim_state_key]))
    )


from . import zero_to_fp32  # noqa: E402,F401 (DeepSpeed: deepspeed.utils.zero_to_fp32)
from .z3_leaf_module import (  # noqa: E402,F401 (DeepSpeed: deepspeed.utils's leaf-module names)
    get_z3_leaf_modules,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)
from ..runtime.dataloader import RepeatingLoader  # noqa: E402,F401 (deepspeed.utils)
