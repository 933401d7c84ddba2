"""DeepSpeed's ``deepspeed.comm`` names: thin wrappers over ``torch.distributed``.

Same names and signatures as DeepSpeed's. One difference, on purpose: without a process group
(a single process started without a launcher, which the engine runs as a world of one) the
queries answer for that world (rank 0 of 1, barrier a no-op) instead of failing, and the
collectives leave their tensors as they are (the sum over one rank).
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as _dist

from .core import dist as _rt

ReduceOp = _dist.ReduceOp

__all__ = [
    "ReduceOp",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "barrier",
    "broadcast",
    "destroy_process_group",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_available",
    "is_initialized",
]


def is_available() -> bool:
    return _dist.is_available()


def is_initialized() -> bool:
    return _rt.is_distributed()


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: datetime.timedelta | float | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config=None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Join the process group. With torchrun's environment (or ``rank`` and ``world_size``
    given with ``init_method``) a group is created; with neither, this is a world of one and
    nothing is created. ``timeout`` defaults as DeepSpeed's does: ``$DEEPSPEED_TIMEOUT`` minutes,
    else 10 minutes, unless ``zero-offload launch --timeout`` gave one
    (:func:`zero_offload.core.dist.default_timeout`). ``auto_mpi_discovery``, ``verbose`` and ``config`` are accepted and
    unused; ``dist_init_required=False`` skips initialization as in DeepSpeed."""
    if dist_init_required is False or is_initialized():
        return
    if init_method is not None or (rank >= 0 and world_size > 0 and "WORLD_SIZE" not in os.environ):
        if rank < 0 or world_size < 1:
            raise ValueError(
                "init_distributed: init_method needs rank >= 0 and world_size >= 1 "
                f"(got rank={rank}, world_size={world_size})"
            )
        backend = dist_backend or ("nccl" if _rt.uses_cuda() else "gloo")
        method = (
            init_method or f"tcp://{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{distributed_port}"
        )
        if backend == "nccl":  # one GPU per rank, current before the group's first collective
            # and the one the engine picks (dist.default_device reads LOCAL_RANK)
            os.environ.setdefault("LOCAL_RANK", str(rank % max(1, torch.cuda.device_count())))
            torch.cuda.set_device(_rt.local_rank())
        _dist.init_process_group(
            backend=backend,
            init_method=method,
            rank=rank,
            world_size=world_size,
            timeout=_rt.as_timeout(timeout),
        )
        return
    _rt.init_distributed(dist_backend, timeout=timeout)


def get_rank(group=None) -> int:
    return _dist.get_rank(group) if is_initialized() else 0


def get_world_size(group=None) -> int:
    return _dist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    return _rt.local_rank()


def barrier(group=None, async_op: bool = False, device_ids=None):
    if not is_initialized():
        return None
    return _dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    if not is_initialized():
        return None
    return _dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False):
    if not is_initialized():
        return None
    return _dist.broadcast(tensor, src, group=group, async_op=async_op)


def all_gather(
    tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None, async_op: bool = False
):
    if not is_initialized():
        tensor_list[0].copy_(tensor)
        return None
    return _dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_into_tensor(
    output_tensor: torch.Tensor, tensor: torch.Tensor, group=None, async_op: bool = False
):
    """Every rank's ``tensor`` into ``output_tensor`` (world size times its elements), in rank
    order. Both are taken as 1-d (gloo refuses a 0-d input that NCCL takes)."""
    if not is_initialized():
        output_tensor.copy_(tensor.reshape(output_tensor.shape))
        return None
    out, inp = output_tensor.view(-1), tensor.reshape(-1)
    return _dist.all_gather_into_tensor(out, inp, group=group, async_op=async_op)


def destroy_process_group(group=None) -> None:
    if is_initialized():
        _dist.destroy_process_group(group)
