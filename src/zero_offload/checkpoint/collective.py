"""The two agreements a checkpoint needs between ranks: the same tag everywhere, and "did every
rank succeed?" before anything irreversible (publishing a save, applying a load).

Both are collectives: every rank calls them at the same point. Flags travel as tensors on the
engine's device (NCCL moves only device tensors).
"""

from __future__ import annotations

import hashlib
import logging

import torch

from ..core import dist
from .format import CheckpointError, TagMismatchError

log = logging.getLogger("zero_offload")


def agree(device: torch.device, err: BaseException | None, what: str, cleanup=None) -> None:
    """Every rank raises if any rank failed ``what`` (a failing rank re-raises its own error),
    after ``cleanup``: a collective, called by every rank at the same point."""
    failed = failed_ranks(device, err is None)
    if failed:
        if cleanup is not None:
            cleanup()
        if err is not None:
            raise err
        raise CheckpointError(f"{what} failed on rank(s) {failed}; nothing was published")


def failed_ranks(device: torch.device, ok: bool) -> list[int]:
    """Every rank learns which ranks reported ``ok=False``."""
    world = dist.world_size()
    if world == 1:
        return [] if ok else [0]
    flags = torch.zeros(world, dtype=torch.int32, device=device)
    mine = torch.tensor([0 if ok else 1], dtype=torch.int32, device=device)
    dist.all_gather(flags, mine)
    return [r for r, f in enumerate(flags.tolist()) if f]


def agree_on_tag(device: torch.device, tag: str, validation: str = "fail") -> str:
    """The tag every rank saves under. Ranks that passed different tags would write different
    directories: ``validation`` "fail" refuses the save; "warn" (DeepSpeed's default) warns and
    "ignore" does not, and both save under rank 0's tag."""
    world = dist.world_size()
    if world == 1:
        return tag
    code = int.from_bytes(hashlib.sha256(tag.encode("utf-8")).digest()[:8], "little", signed=True)
    codes = torch.zeros(world, dtype=torch.int64, device=device)
    dist.all_gather(codes, torch.tensor([code], dtype=torch.int64, device=device))
    if len(set(codes.tolist())) == 1:
        return tag
    if validation == "fail":
        raise TagMismatchError(
            f"tag: ranks passed different tags (rank {dist.rank()} has {tag!r}); every rank "
            'must save under the same tag (checkpoint.tag_validation is "fail")'
        )
    raw = torch.zeros(1024, dtype=torch.uint8, device=device)
    if dist.rank() == 0:
        data = tag.encode("utf-8")[:1024]
        raw[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    dist.broadcast(raw, src=0)
    chosen = bytes(raw.cpu().tolist()).rstrip(b"\0").decode("utf-8", errors="replace")
    if validation == "warn":
        log.warning(
            "checkpoint tag %r on rank %d differs from other ranks'; saving under rank 0's tag "
            '%r (checkpoint.tag_validation: "fail" refuses, "ignore" stays quiet)',
            tag,
            dist.rank(),
            chosen,
        )
    return chosen
