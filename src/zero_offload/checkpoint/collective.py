"""The two agreements a checkpoint needs between ranks: the same tag everywhere, and "did every
rank succeed?" before anything irreversible (publishing a save, applying a load).

Both are collectives: every rank calls them at the same point. Flags travel as tensors on the
engine's device (NCCL moves only device tensors).
"""

from __future__ import annotations

import hashlib

import torch

from ..runtime import dist
from .format import CheckpointError


def failed_ranks(device: torch.device, ok: bool) -> list[int]:
    """Every rank learns which ranks reported ``ok=False``."""
    world = dist.world_size()
    if world == 1:
        return [] if ok else [0]
    flags = torch.zeros(world, dtype=torch.int32, device=device)
    mine = torch.tensor([0 if ok else 1], dtype=torch.int32, device=device)
    dist.all_gather(flags, mine)
    return [r for r, f in enumerate(flags.tolist()) if f]


def check_same_tag(device: torch.device, tag: str) -> None:
    """Refuse a save whose tag differs between ranks (they would write different directories)."""
    world = dist.world_size()
    if world == 1:
        return
    code = int.from_bytes(hashlib.sha256(tag.encode("utf-8")).digest()[:8], "little", signed=True)
    codes = torch.zeros(world, dtype=torch.int64, device=device)
    dist.all_gather(codes, torch.tensor([code], dtype=torch.int64, device=device))
    if len(set(codes.tolist())) != 1:
        raise CheckpointError(
            f"tag: ranks passed different tags (rank {dist.rank()} has {tag!r}); every rank "
            "must save under the same tag"
        )
