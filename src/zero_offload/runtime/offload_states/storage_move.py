"""Move a tensor's storage to the host and back, with every view of it following.

``offload_states`` frees the device memory of the engine's buffers while keeping every object
that refers to them: the params' ``.data`` are views of a flat buffer, ``p.grad`` views of the
flat grad buffer, the fused update's operands views of the master and moments. Moving each
tensor would leave those views on the old memory; resizing the *storage* they share does not.
Offload copies the storage's bytes to a host buffer and resizes the storage to zero bytes (its
device memory goes back to the allocator); reload resizes it back and copies the bytes in. Every
view then reads the same bits as before, at the same offsets.

Invariants:
- a storage is moved at most once (keyed by its storage object); a later request for it (the
  fp32 master that *is* the params, say) only records that state as its owner too, and a host
  copy is never moved (the engine points some tensors at their copies while offloaded);
- while moved, the storage holds zero bytes: any read of a view raises in torch instead of
  returning stale values (the engine's own calls check first and name the state to reload);
- ``keep=False`` (scratch buffers such as the reduce buffers): no copy is made, and reload gives
  the storage back its size with undefined contents, as DeepSpeed does for its grad buckets.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...core.pinned_bytes import host_bytes
from ...core.streams import alloc_host
from ..errors import EngineUsageError


@dataclass
class MovedStorage:
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None  # uint8 copy of the bytes; None: scratch, nothing to restore
    category: str | None  # the memory-report entry these bytes are counted under
    owners: set = field(default_factory=set)  # the offload states that moved it


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """The storage as one uint8 tensor over all its bytes."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def check_movable(t: torch.Tensor, what: str) -> None:
    """Raise, naming ``what``, if ``t``'s storage cannot be resized to zero and back: a numpy
    array or a DLPack capsule made from it, or memory torch does not own, fixes its size."""
    if not t.untyped_storage().resizable():
        raise EngineUsageError(
            f"{what}: its storage cannot be resized (a numpy() or DLPack view of it, or memory "
            "torch does not own, keeps it fixed), so it cannot be offloaded; nothing was moved"
        )


class StorageMover:
    def __init__(self) -> None:
        self.moved: dict[int, MovedStorage] = {}  # storage key -> what was moved
        self.copies: set[int] = set()  # storage keys of the host copies (never moved again)

    def __bool__(self) -> bool:
        return bool(self.moved)

    def offload(
        self,
        t: torch.Tensor,
        owners: set,
        category: str | None,
        pin: bool,
        non_blocking: bool,
        keep: bool = True,
    ) -> None:
        """Move ``t``'s whole storage to the host (a storage of zero bytes is left alone)."""
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.moved:
            self.moved[key].owners |= owners
            return
        n = storage.nbytes()
        if n == 0 or key in self.copies:  # a view the engine points at a host copy meanwhile
            return
        host = None
        if keep:
            host = alloc_host(n, torch.uint8, pin)
            host.copy_(_bytes_view(storage), non_blocking=non_blocking)
            self.copies.add(host.untyped_storage()._cdata)
        storage.resize_(0)
        self.moved[key] = MovedStorage(storage, n, host, category, set(owners))

    def reload(self, non_blocking: bool) -> None:
        """Every moved storage back to its size and bytes."""
        for m in self.moved.values():
            m.storage.resize_(m.nbytes)
            if m.host is not None:
                _bytes_view(m.storage).copy_(m.host, non_blocking=non_blocking)
        self.moved.clear()
        self.copies.clear()

    def moved_storage(self, t: torch.Tensor) -> bool:
        return t.untyped_storage()._cdata in self.moved

    def host_view(self, t: torch.Tensor) -> torch.Tensor | None:
        """``t`` (a view of a moved storage) as the same view of its host copy; None when its
        storage was not moved or had nothing to keep."""
        m = self.moved.get(t.untyped_storage()._cdata)
        if m is None or m.host is None:
            return None
        typed = m.host.view(t.dtype)
        return typed.as_strided(t.size(), t.stride(), t.storage_offset())

    def owners(self) -> set:
        """Every state some moved storage belongs to (the fp32 master that is the params moves
        the params with it)."""
        return set().union(*(m.owners for m in self.moved.values())) if self.moved else set()

    def moved_bytes(self) -> dict[str, int]:
        """Bytes moved per memory-report category."""
        out: dict[str, int] = {}
        for m in self.moved.values():
            if m.category is not None:
                out[m.category] = out.get(m.category, 0) + m.nbytes
        return out

    def held_bytes(self) -> dict[str, int]:
        """Host bytes the moved storages hold per category: what each copy reserves (a pinned
        one under 64 MiB is the caching host allocator's power of two); a storage with nothing
        kept counts its moved bytes, as ``moved_bytes``."""
        out: dict[str, int] = {}
        for m in self.moved.values():
            if m.category is not None:
                held = host_bytes(m.host) if m.host is not None else m.nbytes
                out[m.category] = out.get(m.category, 0) + held
        return out
