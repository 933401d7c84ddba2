"""``deepspeed.comm``: ``zero_offload.comm``'s names, with DeepSpeed's rule that initializing
always leaves a process group: without a launcher's environment, ``init_distributed`` makes a
group of one (callers such as transformers' ZeRO-3 loading call ``torch.distributed`` directly)."""

from __future__ import annotations

import atexit
import datetime

import torch
import torch.distributed as _dist

from ..comm import (  # noqa: F401
    ReduceOp,
    all_gather,
    all_reduce,
    barrier,
    broadcast,
    destroy_process_group,
    get_local_rank,
    get_rank,
    get_world_size,
    is_available,
    is_initialized,
)
from ..comm import all_gather_into_tensor as _all_gather_into_tensor
from ..comm import init_distributed as _init_distributed
from ..core import dist as _rt
from ._common import not_provided_getattr

__getattr__ = not_provided_getattr(__name__)


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
    """DeepSpeed's signature. A launcher's environment (torchrun, ``accelerate launch``,
    ``zero-offload launch``) or ``init_method`` joins that group; with neither, a group of one
    is made in-process (DeepSpeed would try MPI discovery instead). ``auto_mpi_discovery``,
    ``verbose`` and ``config`` are accepted and unused."""
    if dist_init_required is False:
        return
    _init_distributed(
        dist_backend=dist_backend,
        distributed_port=distributed_port,
        timeout=timeout,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
    )
    if _dist.is_initialized():
        return
    device = _rt.default_device()  # before the group exists: CUDA unless forced to the CPU
    backend = dist_backend or ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(device)
    _dist.init_process_group(
        backend=backend,
        store=_dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=_rt.as_timeout(timeout),
    )
    atexit.register(_rt.shutdown)


def get_global_rank(group=None, group_rank: int = 0) -> int:
    return _dist.get_global_rank(group, group_rank) if is_initialized() else group_rank


# DeepSpeed's further collectives, torch.distributed's under DeepSpeed's names and argument
# orders (its profiling keywords accepted and unused): the ones data-parallel user code calls.


def all_gather_into_tensor(output_tensor, tensor, group=None, async_op: bool = False, **_):
    return _all_gather_into_tensor(output_tensor, tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(
    output_tensor, tensor, op=ReduceOp.SUM, group=None, async_op: bool = False, **_
):
    return _dist.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def reduce(tensor, dst: int, op=ReduceOp.SUM, group=None, async_op: bool = False, **_):
    return _dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)


def all_gather_object(object_list, obj, group=None, **_):
    return _dist.all_gather_object(object_list, obj, group=group)


def broadcast_object_list(object_list, src: int, group=None, device=None):
    return _dist.broadcast_object_list(object_list, src, group=group, device=device)


def new_group(ranks):
    return _dist.new_group(ranks)


def get_world_group():
    return _dist.group.WORLD


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True
