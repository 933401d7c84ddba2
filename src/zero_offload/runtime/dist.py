"""Process-group set-up and the few collectives the engine uses, with a world of one needing no
process group at all."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

# torch renamed the tensor-form collectives; use whichever this torch has.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def init_distributed(
    dist_backend: str | None = None,
    timeout: datetime.timedelta = datetime.timedelta(minutes=30),
    **_: object,
) -> None:
    """Join the process group described by torchrun's environment (RANK, WORLD_SIZE, ...).

    nccl on CUDA, gloo on CPU. Without a launcher (no WORLD_SIZE) this does nothing: the engine
    then runs as a world of one. Calling it twice is harmless.
    """
    if dist.is_initialized() or "WORLD_SIZE" not in os.environ:
        return
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(local_rank())
    dist.init_process_group(backend=backend, timeout=timeout)


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def default_device() -> torch.device:
    """CUDA when available, unless the process group is gloo (CPU collectives) or
    ZERO_OFFLOAD_DEVICE=cpu asks for the CPU."""
    forced = os.environ.get("ZERO_OFFLOAD_DEVICE", "").lower()
    if forced not in ("", "cpu", "cuda"):
        raise ValueError(f"ZERO_OFFLOAD_DEVICE must be 'cpu' or 'cuda', got {forced!r}")
    gloo = is_distributed() and dist.get_backend() == "gloo"
    if forced == "cuda" or (not forced and not gloo and torch.cuda.is_available()):
        return torch.device("cuda", local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
    """Sum-reduce ``inp`` across ranks; rank r receives the r-th slice into ``out``."""
    if world_size() == 1:
        out.copy_(inp)
        return None
    return _reduce_scatter(out, inp, async_op=async_op)


def all_gather(out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
    """Gather every rank's ``inp`` into ``out``; ``inp`` may be this rank's own slice of ``out``."""
    if world_size() == 1:
        if inp.data_ptr() != out.data_ptr():
            out.copy_(inp)
        return None
    return _all_gather(out, inp, async_op=async_op)


def all_reduce(t: torch.Tensor, async_op: bool = False):
    if world_size() == 1:
        return None
    return dist.all_reduce(t, async_op=async_op)


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()
