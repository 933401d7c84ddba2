"""While states are offloaded, what a user can reach on the module points at the host copies.

The storages ``offload_states`` empties still back the module's params (``p.data``), stage 1's
``p.grad`` and stage 3's ``p.ds_tensor``. Torch does not check a view against its storage's
size, so a read through ``engine.module`` itself (not the engine's own calls, which check first)
would read freed memory. As DeepSpeed does, each such param is pointed at the same view of the
host copy instead: on a GPU a forward through the module then fails with a device mismatch; on a
CPU it computes with the same values. ``p.grad`` is None while its storage is away. Stage 3's
param shards are pointed at their host copies too, so a gather the module's own hooks or a
``GatheredParameters`` block start reads (and writes) the host copy, which reload carries back.
``restore`` (after the storages are back) puts back the exact tensors that were there.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .storage_move import StorageMover


class ParamRebind:
    def __init__(self) -> None:
        # (owner, attribute or list index, the tensor it held) in the order they were replaced
        self.saved: list[tuple[object, str | int, torch.Tensor]] = []

    def rebind(self, params: Iterable[torch.nn.Parameter], mover: StorageMover) -> None:
        """Point every param whose storage ``mover`` moved at its host copy."""
        for p in params:
            view = mover.host_view(p.data)
            if view is not None:
                self.saved.append((p, "data", p.data))
                p.data = view
            shard = getattr(p, "ds_tensor", None)
            view = mover.host_view(shard) if shard is not None else None
            if view is not None:
                self.saved.append((p, "ds_tensor", shard))
                p.ds_tensor = view
            if p.grad is not None and mover.moved_storage(p.grad):
                self.saved.append((p, "grad", p.grad))
                p.grad = None

    def rebind_list(self, tensors: list, mover: StorageMover) -> None:
        """Each entry of ``tensors`` (None allowed) whose storage was moved: its host copy."""
        for i, t in enumerate(tensors):
            view = mover.host_view(t) if t is not None else None
            if view is not None:
                self.saved.append((tensors, i, t))
                tensors[i] = view

    def restore(self) -> None:
        """The tensors replaced, back in reverse order (their storages must be back first)."""
        for owner, key, t in reversed(self.saved):
            if isinstance(key, int):
                owner[key] = t
            else:
                setattr(owner, key, t)
        self.saved.clear()
