"""Where each group's optimizer state is built, from the placement: tensors in device or host
memory, or swap files on NVMe (checked for room and preallocated before the first step)."""

from __future__ import annotations

import torch

from ..config.errors import ConfigError
from ..nvme.aio import AioEngine
from ..nvme.optimizer_state import NvmeOptimizerState
from ..nvme.param_shard import NvmeParams
from ..nvme.preflight import check_nvme_path
from .flat_group import FlatGroup
from .placement import CHUNK_ALIGN, Placement
from .shard_state import MemoryState, ShardState

OPTIMIZER_PATH_KEY = "zero_optimization.offload_optimizer.nvme_path"
PARAM_PATH_KEY = "zero_optimization.offload_param.nvme_path"
BUFFER_SIZE_KEY = "zero_optimization.offload_param.buffer_size"


def nvme_state_bytes(numel: int, chunk: int) -> int:
    """Swap bytes of one group's NVMe state: two versions of a 12-byte record per element,
    whole chunks (``optimizer_state.py``'s layout)."""
    return 2 * max(1, -(-numel // chunk)) * chunk * 12


def _state_chunk(numel: int, chunk: int) -> int:
    """A state smaller than one update chunk has one record of its own (rounded) size."""
    return min(chunk, max(CHUNK_ALIGN, -(-numel // CHUNK_ALIGN) * CHUNK_ALIGN))


def build_states(
    groups: list[FlatGroup],
    sharded: bool,
    placement: Placement,
    aio: AioEngine | None,
    local_world: int,
    moments: bool,
) -> list[ShardState]:
    """One empty state per group. NVMe: the rank's folder is checked for room for every rank
    of this node (they usually share the disk) and the files are preallocated, so a full disk
    is an error at start-up, naming the path, not in the middle of a step."""
    numels = [g.shard_numel(sharded) for g in groups]
    if not groups:  # no optimizer: forward only
        return []
    if placement.optimizer != "nvme":
        where = "host" if placement.host_update else "device"
        device = torch.device("cpu") if placement.host_update else groups[0].device
        return [MemoryState(n, device, where, moments) for n in numels]
    assert placement.nvme is not None and placement.nvme.optimizer_dir is not None and aio
    folder = placement.nvme.optimizer_dir
    need = sum(nvme_state_bytes(n, _state_chunk(n, placement.chunk)) for n in numels)
    need *= local_world
    check_nvme_path(OPTIMIZER_PATH_KEY, folder.parents[3], need)  # <nvme_path>
    states = [
        NvmeOptimizerState(
            folder,
            f"group{g.index}",
            n,
            _state_chunk(n, placement.chunk),
            placement.nvme.optimizer_buffer_count,
            aio,
            placement.pin,
        )
        for g, n in zip(groups, numels)
    ]
    return states


def build_nvme_params(
    groups: list[FlatGroup], placement: Placement, aio: AioEngine | None, local_world: int
) -> NvmeParams | None:
    """Stage 3 with ``offload_param`` "nvme": the folder checked for room (every rank of the
    node), and ``buffer_size`` checked against the largest fetch unit, whose slice one read
    buffer must hold (DeepSpeed's rule: the largest param)."""
    if placement.params != "nvme":
        return None
    nv = placement.nvme
    assert nv is not None and nv.param_dir is not None and aio is not None
    need = sum(g.layout.shard_numel * g.dtype.itemsize + 4096 for g in groups) * local_world
    check_nvme_path(PARAM_PATH_KEY, nv.param_dir.parents[3], need)  # <nvme_path>
    largest, name = 0, ""
    for g in groups:
        for b in g.layout.buckets:
            if b.slice_numel > largest:
                largest, name = b.slice_numel, g.names[b.params[0]] if b.params else ""
    if largest > nv.param_buffer_size:
        raise ConfigError(
            f"{BUFFER_SIZE_KEY}: {nv.param_buffer_size} elements is smaller than this rank's "
            f"slice of the largest fetch unit ({largest} elements, the module holding "
            f"{name!r}); set it to at least {largest}"
        )
    return NvmeParams(nv.param_dir, aio, nv.max_in_cpu, nv.param_buffer_count)
