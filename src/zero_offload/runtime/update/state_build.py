"""Where each group's optimizer state is built, from the placement: tensors in device or host
memory, or swap files on NVMe (checked for room and preallocated before the first step)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ...config.errors import ConfigError
from ...core.flat_group import FlatGroup
from ...core.state.alias_state import AliasState
from ...core.state.compact_state import CompactState
from ...core.state.shard_state import MemoryState, ShardState
from ...core.state.twin_state import TwinState
from ...nvme.io.aio import AioEngine
from ...nvme.optimizer_state import NvmeOptimizerState
from ...nvme.param_shard import NvmeParams
from ...nvme.path_agreement import PathNeed, agree, check_nvme_paths
from ...nvme.record_layout import nvme_state_bytes
from .placement import CHUNK_ALIGN, Placement

OPTIMIZER_PATH_KEY = "zero_optimization.offload_optimizer.nvme_path"
RATIO_KEY = "zero_optimization.offload_optimizer.ratio"
PARAM_PATH_KEY = "zero_optimization.offload_param.nvme_path"
BUFFER_SIZE_KEY = "zero_optimization.offload_param.buffer_size"


def _state_chunk(numel: int, chunk: int) -> int:
    """A state smaller than one update chunk has one record of its own (rounded) size."""
    return min(chunk, max(CHUNK_ALIGN, -(-numel // CHUNK_ALIGN) * CHUNK_ALIGN))


def build_states(
    groups: list[FlatGroup],
    sharded: bool,
    placement: Placement,
    aio: AioEngine | None,
    moments: bool,
) -> list[ShardState]:
    """One empty state per group (NVMe: preallocated swap files; ``preflight`` ran first), in
    the placement's state format: every placement keeps every format."""
    numels = [g.shard_numel(sharded) for g in groups]
    if not groups:  # no optimizer: forward only
        return []
    fmt = placement.state

    def memory(n: int, device: torch.device, where: str) -> ShardState:
        if fmt.compact:  # bf16 or 8-bit master and moments (compact_state.py)
            return CompactState(n, device, where, fmt)
        return MemoryState(n, device, where, moments)

    if placement.twin:  # the device part, then the host part (twin_update.py)
        cpu, dev = torch.device("cpu"), groups[0].device
        cuts = [placement.host_from(n) for n in numels]  # whole 8-bit blocks on either side
        return [
            TwinState(memory(c, dev, "device"), memory(n - c, cpu, "host"))
            for c, n in zip(cuts, numels)
        ]
    if placement.optimizer != "nvme":
        where = "host" if placement.host_update else "device"
        device = torch.device("cpu") if placement.host_update else groups[0].device
        return [memory(n, device, where) for n in numels]
    assert placement.nvme is not None and placement.nvme.optimizer_dir is not None and aio
    return [
        NvmeOptimizerState(
            placement.nvme.optimizer_dir,
            f"group{g.index}",
            n,
            _state_chunk(n, placement.chunk),
            placement.nvme.optimizer_buffer_count,
            aio,
            placement.pin,
            placement.state,
        )
        for g, n in zip(groups, numels)
    ]


def alias_state(
    group: FlatGroup,
    home,
    sharded: bool,
    placement: Placement,
    client: object | None,
    moments: bool | None = None,
) -> AliasState | None:
    """Params whose master would sit beside them: the master shard is the param home's own
    values (``alias_state.py``), its moments in the state format. Two placements hold that: the
    optimizer and the params on the device, or (stage 3) both in host memory
    (``offload_optimizer`` and ``offload_param`` "cpu"), where the host kernel then updates the
    param shard in place. The master is the params' dtype: fp32 training's fp32 master, or a
    bf16 master (``bf16_master_weights_and_grads``) of bf16 params. None where it cannot be: a
    master of another dtype than the params, the optimizer and the params in different places,
    NVMe, a partial
    offload (a twin's two parts), the delayed update (its worker writes while the next forward
    reads the home), or a client optimizer (which steps one tensor) over a sharded flat buffer
    whose partition is not one contiguous range. ``moments``: allocate Adam's moments
    (default: unless a client optimizer keeps its own state)."""
    fmt = placement.state
    if group.dtype != fmt.master or not _beside(placement, home.where):
        return None
    if client is not None and home.shard_tensor() is None:
        return None
    moments = client is None if moments is None else moments
    return AliasState(home, group.segments(sharded), group.shard_numel(sharded), moments, fmt)


def _beside(placement: Placement, home_where: str) -> bool:
    """The optimizer state would live where the param home is, in memory, updated in place."""
    if placement.optimizer == "device":
        return home_where == "device"
    host = placement.optimizer == "host" and not placement.twin and not placement.delayed
    return host and home_where == "host"


def build_nvme_params(placement: Placement, aio: AioEngine | None) -> NvmeParams | None:
    """Stage 3 with ``offload_param`` "nvme": where the store's swap files go."""
    if placement.params != "nvme":
        return None
    nv = placement.nvme
    assert nv is not None and nv.param_dir is not None and aio is not None
    return NvmeParams(nv.param_dir, aio, nv.max_in_cpu, nv.param_buffer_count)


def preflight(
    placement: Placement,
    groups: list[FlatGroup],
    store_groups: list[FlatGroup] | None,
    sharded: bool,
    client: object | None,
    device: torch.device,
) -> None:
    """Every NVMe setting checked before anything is partitioned or written (a stage-3 model
    whose params went to swap files could not be handed back), on every rank at once: if any
    rank fails, every rank raises (none waits in a collective alone). Each ``nvme_path`` is
    created and cleared of dead runs' folders by one rank per node while the others wait
    (``nvme/path_agreement.py``)."""
    if client is not None and placement.twin:  # every rank alike: before any collective
        raise ValueError(
            f"{RATIO_KEY} {placement.ratio}: partial offload updates with the built-in Adam(W) "
            f"on both the device and the host; a client optimizer ({type(client).__name__}) "
            'cannot be split (as DeepSpeed): use an "optimizer" config block, or ratio 1.0'
        )
    error: Exception | None = None
    needs: list[PathNeed] = []
    try:
        needs = _needs(placement, groups, store_groups, sharded, client)
    except Exception as e:  # any failure: this rank must still take part in the agreement
        error = e
    if placement.nvme is None:  # every rank alike (the configs agree)
        agree(error, device)
    else:
        check_nvme_paths(needs, device, error)


def _needs(placement, groups, store_groups, sharded, client) -> list[PathNeed]:
    """The ``nvme_path``s this rank's swap files go under, with the free bytes each needs."""
    nv = placement.nvme
    if nv is None:
        return []
    if client is not None and placement.optimizer == "nvme":
        raise ValueError(
            f"a client optimizer ({type(client).__name__}) keeps its own state in memory; "
            'zero_optimization.offload_optimizer.device "nvme" streams the built-in '
            'Adam(W) state only: use "cpu", or an "optimizer" config block'
        )
    needs: list[tuple[str, Path, int]] = []  # (key, nvme_path, bytes of this rank's files)
    if placement.optimizer == "nvme" and groups:
        assert nv.optimizer_dir is not None
        numels = [g.shard_numel(sharded) for g in groups]
        chunk = placement.chunk
        need = sum(nvme_state_bytes(n, _state_chunk(n, chunk), placement.state) for n in numels)
        needs.append((OPTIMIZER_PATH_KEY, nv.optimizer_dir.parents[3], need))  # <nvme_path>
    if placement.params == "nvme" and store_groups:
        assert nv.param_dir is not None
        need = sum(g.layout.shard_numel * g.dtype.itemsize + 4096 for g in store_groups)
        needs.append((PARAM_PATH_KEY, nv.param_dir.parents[3], need))
        _check_buffer_size(nv.param_buffer_size, store_groups)
    # Every rank of this node checks before any rank preallocates (the agreement is the
    # barrier), so each counts the node's ranks (they usually share the drive) and both kinds
    # of files when their paths are on one filesystem: conservative, never racy.
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    out = []
    for key, path, need in needs:
        same_fs = [n for k, p, n in needs if k != key and _same_filesystem(p, path)]
        out.append(PathNeed(key, path, (need + sum(same_fs)) * local))
    return out


def _same_filesystem(a: Path, b: Path) -> bool:
    try:
        return os.stat(a).st_dev == os.stat(b).st_dev
    except OSError:
        return False  # check_nvme_path names the problem


def _check_buffer_size(buffer_size: int, groups: list[FlatGroup]) -> None:
    """DeepSpeed's rule: one read buffer holds the largest param's partition."""
    world = groups[0].layout.world_size
    largest, name = 0, ""
    for g in groups:
        for n, numel in zip(g.names, g.layout.numels):
            if -(-numel // world) > largest:
                largest, name = -(-numel // world), n
    if largest > buffer_size:
        raise ConfigError(
            f"{BUFFER_SIZE_KEY}: {buffer_size} elements is smaller than the partition of the "
            f"largest param ({name!r}: {largest} elements per rank); set it to at least {largest}"
        )
