"""Params partitioned at construction (``zero.Init``), before any engine exists.

Each param is cut into ``world_size`` equal chunks (the last padded); rank r keeps chunk r as
``p.ds_tensor`` (on the device, or on the host with ``remote_device`` "cpu"/"nvme" or the
config's ``offload_param``) and ``p.data`` is emptied. ``full_value`` gathers a whole param back:
the engine does it one param at a time when it builds its own layout, so building never needs
more than one full param beyond the shards.
"""

from __future__ import annotations

import itertools
import math

import torch

from ...core import dist, partitioned
from ...core.status import ZeroParamStatus
from ...core.streams import alloc_host

_ids = itertools.count()


def next_ds_id() -> int:
    return next(_ids)


class InitShard:
    """How a ``zero.Init`` param is split; recorded on the param by ``partitioned.set_init_shard``."""

    def __init__(self, numel: int, shape: tuple[int, ...], world: int, rank: int) -> None:
        self.numel, self.shape, self.world = numel, shape, world
        self.chunk = max(1, math.ceil(numel / world))
        self.lo = min(rank * self.chunk, numel)
        self.hi = min(self.lo + self.chunk, numel)


def partition_at_init(
    p: torch.nn.Parameter, shard_device: torch.device, dtype: torch.dtype | None, pin: bool
) -> None:
    """Keep this rank's chunk of ``p`` (rank 0's values: broadcast first, so every rank starts
    from the same weights) and empty ``p.data``."""
    if partitioned.is_partitioned(p):
        return
    comm = dist.default_device()
    data = p.data.to(comm)
    if dtype is not None and data.is_floating_point():
        data = data.to(dtype)
    dist.broadcast(data, src=0)
    spec = InitShard(data.numel(), tuple(data.shape), dist.world_size(), dist.rank())
    src = data.reshape(-1)[spec.lo : spec.hi]
    if pin and shard_device.type == "cpu" and torch.cuda.is_available():
        # alloc_host, not .pin_memory(): a chunk of 64 MiB or more is page-locked at its own
        # size instead of a power-of-two block the caching host allocator never gives back.
        own = alloc_host(src.numel(), src.dtype, pin=True)
        own.copy_(src)
    else:
        own = src.to(shard_device, copy=True)
    partitioned.set_init_shard(p, spec)
    p.ds_tensor = own
    p.ds_numel = spec.numel
    p.ds_shape = torch.Size(spec.shape)
    p.ds_id = next_ds_id()
    p.ds_status = ZeroParamStatus.NOT_AVAILABLE
    p.data = torch.empty(0, dtype=data.dtype, device=comm)


def full_value(p: torch.nn.Parameter) -> torch.Tensor:
    """The whole param: its data, or for a ``zero.Init`` param the gathered chunks (a collective
    on every rank)."""
    spec = partitioned.init_shard(p)
    if spec is None:
        return p.data
    comm = dist.default_device()
    buf = torch.zeros(spec.chunk * spec.world, dtype=p.ds_tensor.dtype, device=comm)
    own = buf[dist.rank() * spec.chunk : dist.rank() * spec.chunk + (spec.hi - spec.lo)]
    own.copy_(p.ds_tensor)
    mine = buf[dist.rank() * spec.chunk : (dist.rank() + 1) * spec.chunk]
    dist.all_gather(buf, mine)
    return buf[: spec.numel].view(spec.shape)


def materialize(p: torch.nn.Parameter) -> None:
    """Turn a ``zero.Init`` param back into an ordinary full param (for stages 0-2)."""
    if partitioned.init_shard(p) is None:
        return
    p.data = full_value(p).clone()
    partitioned.clear_init_shard(p)
    for attr in ("ds_tensor", "ds_numel", "ds_shape", "ds_id", "ds_status"):
        delattr(p, attr)


def write_back(p: torch.nn.Parameter, full: torch.Tensor) -> None:
    """Store this rank's chunk of ``full`` as the param's shard."""
    spec = partitioned.init_shard(p)
    p.ds_tensor.copy_(full.reshape(-1)[spec.lo : spec.hi])
