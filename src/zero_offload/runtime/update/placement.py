"""Placement: where each rank's optimizer state and 16-bit param shard live, as one typed policy.

Two independent choices, read once from ``zero_optimization`` when the engine is built:

- ``optimizer`` (the fp32 master shard and Adam moments, and so where the update runs):
  ``device`` (torch's fused Adam on the accelerator), ``host`` (``offload_optimizer`` "cpu": the
  SIMD host kernel over host memory) or ``nvme`` (``offload_optimizer`` "nvme": the same kernel,
  streamed chunk by chunk through a few aligned host buffers from per-rank swap files);
- ``params`` (stage 3's 16-bit param shard between uses): ``device``, ``host``
  (``offload_param`` "cpu") or ``nvme`` (``offload_param`` "nvme": read from a swap file into
  host buffers ahead of the fetch).

Partial offload (``offload_optimizer.ratio`` < 1, DeepSpeed's ZeRO-Offload++ "Twin-Flow", stage 3
with optimizer "host"): each group's shard is cut at ``host_from(numel)``; the device part
``[0, host_from)`` keeps its master and moments on the accelerator and is updated there, the host
part ``[host_from, numel)`` in host memory by the host kernel, both in the same step.

Invariant: the components receive this object (or one of its parts), never the config; a
placement other than ``device`` always has the host kernel on the update path, so ``host_update``
is the one question the gradient path asks.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from ...core.state.format import FP32, StateFormat
from ...nvme.io.aio import AioPolicy

Where = Literal["device", "host", "nvme"]
_FROM_CONFIG: dict[str, Where] = {"none": "device", "cpu": "host", "nvme": "nvme"}

# The host update's unit of work: at most 4M elements (16 MB of fp32 per state tensor), a
# multiple of 2048 elements so that every chunk of a 16-bit shard starts on a 4096-byte boundary
# (direct I/O of the param swap file writes chunk by chunk).
MAX_CHUNK = 1 << 22
CHUNK_ALIGN = 2048


def twin_split(numel: int, ratio: float) -> int:
    """Where a shard of ``numel`` elements is cut for ``ratio`` of it on the host: the device
    part's size, ``(1 - ratio) * numel`` rounded to a whole number of ``CHUNK_ALIGN`` elements
    (so every host chunk starts on a 4096-byte boundary of a swap file), within [0, numel]."""
    if ratio >= 1.0:
        return 0
    if ratio <= 0.0:  # DeepSpeed accepts 0: every element on the device
        return numel
    units = round((1.0 - ratio) * numel / CHUNK_ALIGN)
    return min(numel, units * CHUNK_ALIGN)


def update_chunk(sub_group_size: int) -> int:
    """Elements per host-update chunk for ``sub_group_size`` (DeepSpeed's unit of the update)."""
    n = min(int(sub_group_size), MAX_CHUNK)
    return max(CHUNK_ALIGN, n - n % CHUNK_ALIGN)


@dataclass(frozen=True)
class NvmePolicy:
    """Swap files of one rank: the folders, DeepSpeed's buffer keys and the aio settings."""

    optimizer_dir: Path | None = None  # <nvme_path>/zero_offload_swap/<run>/rank<r>/optimizer
    param_dir: Path | None = None
    optimizer_buffer_count: int = 4
    param_buffer_count: int = 5
    param_buffer_size: int = 100_000_000  # elements per param read buffer
    max_in_cpu: int = 1_000_000_000  # param elements kept in host memory between fetches
    aio: AioPolicy = field(default_factory=AioPolicy)


@dataclass(frozen=True)
class Placement:
    optimizer: Where = "device"
    params: Where = "device"
    pin: bool = (
        False  # page-locked optimizer-side host buffers (CUDA, offload_optimizer.pin_memory)
    )
    chunk: int = MAX_CHUNK  # host-update chunk, elements
    threads: int | None = None  # host kernel threads (None: one per core)
    nvme: NvmePolicy | None = None
    # The delayed update (optimizer "host" only): from this step on, the host update of step t
    # runs while step t+1 computes; None: every update runs inside its step.
    delayed_after: int | None = None
    # The share of each group's shard whose state lives on the host (optimizer "host" only;
    # 1.0: all of it). Below 1.0 the rest stays on the device: the twin update.
    ratio: float = 1.0
    # How the master and moments store each element (fp32; bf16 or 8-bit: ``format.py``).
    state: StateFormat = FP32

    @property
    def host_update(self) -> bool:
        """The update runs on the host (master and moments in host memory or on NVMe), for the
        whole shard or (``twin``) for its host part."""
        return self.optimizer != "device"

    @property
    def twin(self) -> bool:
        """Partial offload: a device part and a host part per group, updated side by side."""
        return self.optimizer == "host" and self.ratio < 1.0

    def host_from(self, numel: int) -> int:
        """The shard offset where a group's host-resident part begins: 0 when the whole state
        is offloaded, ``numel`` when none of it is (optimizer "device"), else the twin's cut."""
        if not self.host_update:
            return numel
        return twin_split(numel, self.ratio) if self.twin else 0

    @property
    def delayed(self) -> bool:
        return self.delayed_after is not None

    @classmethod
    def from_config(cls, config, device: torch.device, rank: int, run: str) -> Placement:
        """``run`` names this engine's swap folder (unique per process and engine), so two
        runs sharing an ``nvme_path`` never write the same file."""
        zc = config.zero_optimization
        oc, pc = zc.offload_optimizer, zc.offload_param
        optimizer = _FROM_CONFIG[zc.offload_device]
        params = _FROM_CONFIG[zc.offload_param_device]
        cuda = device.type == "cuda"
        pin = cuda and oc is not None and optimizer != "device" and bool(oc.pin_memory)
        nvme = None
        if "nvme" in (optimizer, params):

            def folder(path: str | None, what: str) -> Path | None:
                if path is None:
                    return None
                return Path(path) / "zero_offload_swap" / run / f"rank{rank:05d}" / what

            aio = config.aio
            nvme = NvmePolicy(
                optimizer_dir=folder(zc.optimizer_nvme_path, "optimizer"),
                param_dir=folder(zc.param_nvme_path, "param"),
                optimizer_buffer_count=int(oc.buffer_count) if oc is not None else 4,
                param_buffer_count=int(pc.buffer_count) if pc is not None else 5,
                param_buffer_size=int(pc.buffer_size) if pc is not None else 100_000_000,
                max_in_cpu=int(pc.max_in_cpu) if pc is not None else 1_000_000_000,
                aio=AioPolicy(
                    block_size=int(aio.block_size),
                    queue_depth=int(aio.queue_depth),
                    threads=int(aio.threads),
                    single_submit=bool(aio.single_submit),
                    overlap_events=bool(aio.overlap_events),
                ),
            )
        return cls(
            optimizer=optimizer,
            params=params,
            pin=pin,
            chunk=update_chunk(zc.sub_group_size),
            threads=oc.threads if oc is not None and optimizer != "device" else None,
            nvme=nvme,
            delayed_after=(
                int(oc.delayed_update_after)
                if optimizer != "device" and oc is not None and oc.delayed_update
                else None
            ),
            ratio=float(oc.ratio) if optimizer == "host" and oc is not None else 1.0,
            state=StateFormat.from_config(config),
        )


def run_name() -> str:
    """A swap-folder name unique to this engine: the host, the process and a random part, so
    two jobs sharing an ``nvme_path`` (containers with equal pids, a shared mount) never
    write or remove each other's files."""
    return f"{socket.gethostname()}-pid{os.getpid()}-{uuid.uuid4().hex[:12]}"
