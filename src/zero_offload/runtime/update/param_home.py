"""Where the 16-bit values of a rank's partition live, and how an update becomes visible.

The shard optimizer writes its updated 16-bit slices through ``own(seg)`` and then calls
``publish()``. Two homes:

- ``FlatHome`` (stages 0-2): the slices are this rank's ranges of the full flat buffer on the
  device; ``publish`` all-gathers every bucket in place so every rank computes with the new params.
- ``ShardHome`` (stage 3, param_store.py): the slices are the rank's param shard (device, or host
  memory with ``offload_param``); ``publish`` drops stale gathered copies, since params travel
  when a module fetches them, and gathers the group's persistent params again at once.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ...core import dist
from ...core.flat_group import FlatGroup
from ...core.streams import Streams


class ParamHome(Protocol):
    """Addressed in the shard index space (the master shard's coordinates)."""

    # "device"; "host": host memory (stage 3 with offload_param "cpu"); "nvme": a swap file
    # (offload_param "nvme"), written chunk by chunk. The placement's ``params`` for this group.
    where: str

    def read(self, lo: int, hi: int) -> torch.Tensor:
        """The 16-bit values of shard elements [lo, hi) (a view where they are contiguous)."""
        ...

    def write(self, lo: int, src: torch.Tensor, non_blocking: bool = False) -> None:
        """Shard elements [lo, lo + src.numel()) take ``src`` (cast to the home's dtype)."""
        ...

    def host_shard(self) -> torch.Tensor | None:
        """The whole host-resident 16-bit shard, which the host update may write in place."""
        ...

    def write_target(self, lo: int, hi: int) -> torch.Tensor | None:
        """A host tensor the caller fills with shard elements [lo, hi), then submits with
        ``finish_write`` (a swap file's write buffer: no staging copy), or None."""
        ...

    def finish_write(self) -> None: ...

    def shard_views(self, segs) -> list[torch.Tensor]:
        """Views of the home's own storage, one per segment of ``segs`` (homes in device or host
        memory only)."""
        ...

    def shard_tensor(self) -> torch.Tensor | None:
        """The whole shard as one view of the home's storage, where it is stored contiguously in
        shard order; None otherwise (a home in device or host memory, whose values the update may write
        in place)."""
        ...

    def prepare_write(self) -> None:
        """Before the update writes: nothing may still be reading the values it replaces."""
        ...

    def flush(self) -> None:
        """Every write so far has landed (a swap file's writes may still be in flight)."""
        ...

    def publish(self) -> None: ...

    def device_params(self) -> tuple[torch.Tensor, str] | None:
        """The home's 16-bit params on the device as one tensor, with their memory-report
        entry (``offload_states`` moves it); None for a home in host memory or on NVMe."""
        ...


class FlatHome:
    where = "device"

    def __init__(
        self,
        group: FlatGroup,
        streams: Streams,
        sharded: bool,
        allgather_bucket_size: int,
        allgather_partitions: bool = True,
    ) -> None:
        self.group, self.streams, self.sharded = group, streams, sharded
        self.allgather_bucket_size = max(1, int(allgather_bucket_size))
        self.allgather_partitions = allgather_partitions
        self.segs = group.segments(sharded)

    def _pieces(self, lo: int, hi: int):
        """(flat start, offset in [lo, hi), numel) of each segment piece of shard [lo, hi)."""
        for s in self.segs:
            a, b = max(lo, s.shard_start), min(hi, s.shard_start + s.numel)
            if a < b:
                yield s.flat_start + a - s.shard_start, a - lo, b - a

    def read(self, lo: int, hi: int) -> torch.Tensor:
        flat = self.group.flat
        parts = [flat[f : f + n] for f, _, n in self._pieces(lo, hi)]
        if len(parts) <= 1:
            return parts[0] if parts else flat[:0]
        return torch.cat(parts)

    def write(self, lo: int, src: torch.Tensor, non_blocking: bool = False) -> None:
        flat = self.group.flat
        pieces = list(self._pieces(lo, lo + src.numel()))
        if len(pieces) == 1:
            f, at, n = pieces[0]
            flat[f : f + n].copy_(src[at : at + n], non_blocking=non_blocking)
        elif pieces:  # one launch for every bucket's piece
            dst = [flat[f : f + n] for f, _, n in pieces]
            torch._foreach_copy_(
                dst, [src[at : at + n] for _, at, n in pieces], non_blocking=non_blocking
            )

    def host_shard(self) -> None:
        return None

    def write_target(self, lo: int, hi: int) -> None:
        return None

    def finish_write(self) -> None:
        raise AssertionError("a device home has no write target")

    def shard_views(self, segs) -> list[torch.Tensor]:
        flat = self.group.flat
        return [flat[s.flat_start : s.flat_start + s.numel] for s in segs]

    def shard_tensor(self) -> torch.Tensor | None:
        """Contiguous when every segment sits at the same offset from its shard position
        (stage 0, one rank, or one bucket); then the segments tile one range of ``flat``."""
        shift = {s.flat_start - s.shard_start for s in self.segs}
        if len(shift) != 1:
            return None
        (off,) = shift
        n = self.group.shard_numel(self.sharded)
        return self.group.flat[off : off + n]

    def prepare_write(self) -> None:
        """The flat buffer's own slices are only read by compute, which the uploads wait for."""

    def flush(self) -> None:
        """Writes into the flat buffer are copies: nothing is in flight."""

    def publish(self) -> None:
        """Rebuild every bucket of the flat buffer from all ranks' updated slices, in place."""
        st = self.streams
        st.wait(None, st.h2d)  # uploads land before the gather reads them
        if not self.sharded or dist.world_size() == 1:
            return
        flat, rank, world = self.group.flat, self.group.rank, dist.world_size()
        for b in self.group.layout.buckets:
            n = b.slice_numel
            if not self.allgather_partitions:  # DeepSpeed's alternative: one broadcast per rank
                for r in range(world):
                    dist.broadcast(flat[b.start + r * n : b.start + (r + 1) * n], src=r)
                continue
            piece = max(1, self.allgather_bucket_size // world)
            if piece >= n:
                own = flat[b.start + rank * n : b.start + (rank + 1) * n]
                dist.all_gather(flat[b.start : b.start + b.numel], own)
                continue
            for lo in range(0, n, piece):  # bucket larger than allgather_bucket_size: in pieces
                hi = min(lo + piece, n)
                outs = [flat[b.start + r * n + lo : b.start + r * n + hi] for r in range(world)]
                torch.distributed.all_gather(outs, outs[rank].clone())

    def device_params(self) -> tuple[torch.Tensor, str] | None:
        return self.group.flat, "device.params"  # the whole flat buffer: every rank holds it
