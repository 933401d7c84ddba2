"""The host buffers of a model's NVMe param shards, bounded together (``offload_param``).

Every ``NvmeParamShard`` of one param store shares one ``ParamCache``, so the config's bounds
hold for the whole model, not per group:

- at most ``max_slices`` cached slices (``offload_param.buffer_count``) across every shard: the
  slices read ahead of the fetches and the most recently used ones. The fetch schedule reads
  ``buffer_count`` slots ahead, so a slice used in the forward is not kept for the backward: the
  cache never grows to the model's size (it did: all of a model's param shard stayed in host
  memory after the first forward whenever it fit within ``max_in_cpu``);
- cached elements plus the elements of the buffers kept for reuse (spares) at most
  ``max_in_cpu`` across every shard (a pinned slice counts what its buffer reserves,
  ``NvmeParamShard.charge``: the caching host allocator rounds a small one up to a power of two) (DeepSpeed's meaning: the param elements in host memory for
  the whole model);
- ``peak_bytes``: the most bytes held at once by the cache, the spares and the writes in flight,
  since ``reset_peak`` (``memory_report()``'s ``peak.host.param_buffers``).

An entry is ``[buffer, first byte of the slice in it, pending read or None, used]``, keyed by
``(shard, lo, hi)``, least recently used first. The shard that owns an entry drops it (it waits
for the entry's read and recycles the buffer).
"""

from __future__ import annotations

import collections


class ParamCache:
    def __init__(self, max_in_cpu: int, max_slices: int = 2**31) -> None:
        self.max_in_cpu = max_in_cpu
        self.max_slices = max(1, max_slices)
        self.entries: collections.OrderedDict = collections.OrderedDict()
        self.cached = 0  # elements held by the entries (``shard.charge``: reserved, pinned)
        self.spare = 0  # elements held by every shard's buffers kept for reuse
        self.shards: list = []  # every shard sharing this cache (for spares and the peak)
        self.peak_bytes = 0
        self.peak_slices = 0  # the most entries held at once (never above max_slices)

    def register(self, shard) -> None:
        self.shards.append(shard)

    def room(self, n: int) -> bool:
        """``n`` more cached elements fit in both bounds."""
        return self.cached + n <= self.max_in_cpu and len(self.entries) < self.max_slices

    def make_room(self, n: int, used_only: bool) -> bool:
        """Evict least recently used entries (used ones only, or any) until a slice of ``n``
        elements fits; whether it does. A read-ahead passes ``used_only``: it never evicts an
        entry not used yet (it would throw away its own earlier guess)."""
        if n > self.max_in_cpu:
            return False
        for key in list(self.entries):
            if self.room(n):
                break
            if self.entries[key][3] or not used_only:
                key[0].drop(key)
        return self.room(n)

    def insert(self, key: tuple, entry: list) -> None:
        self.entries[key] = entry
        self.cached += key[0].charge(key[1], key[2])
        self.peak_slices = max(self.peak_slices, len(self.entries))
        self.trim_spares()
        self.note()

    def pop(self, key: tuple) -> list:
        entry = self.entries.pop(key)
        self.cached -= key[0].charge(key[1], key[2])
        return entry

    def trim_spares(self) -> None:
        """Free kept buffers, largest first, until they fit beside the cache in max_in_cpu."""
        for shard in self.shards:
            shard.trim_spares(max(0, self.cached + self.spare - self.max_in_cpu))

    def held_bytes(self) -> int:
        return sum(shard.held_bytes() for shard in self.shards)

    def note(self) -> None:
        """Record the bytes held now if they are the most so far."""
        self.peak_bytes = max(self.peak_bytes, self.held_bytes())

    def reset_peak(self) -> None:
        self.peak_bytes = self.held_bytes()
