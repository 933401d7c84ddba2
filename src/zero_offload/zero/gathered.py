"""``GatheredParameters``: full params of a partitioned model inside a block; with
``modifier_rank``, that rank's edits become every rank's shard (and fp32 master) on exit.

Collective: every rank enters and leaves the block with the same params, in the same order.
Works for params managed by a stage-3 engine (fetched through its param store and kept gathered,
pinned, while the block runs) and for params partitioned by ``zero.Init`` before any engine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

from ..core import dist, partitioned
from ..core.status import ZeroParamStatus
from ..runtime.stage3.init_partition import full_value, write_back


def _as_list(params) -> list[torch.nn.Parameter]:
    if params is None:
        return []
    if isinstance(params, torch.Tensor):
        return [params]
    return list(dict.fromkeys(params))


class GatheredParameters:
    def __init__(
        self,
        params: torch.nn.Parameter | Iterable[torch.nn.Parameter],
        modifier_rank: int | None = None,
        fwd_module: torch.nn.Module | None = None,
        enabled: bool = True,
    ) -> None:
        if modifier_rank is not None and (
            isinstance(modifier_rank, bool)
            or not isinstance(modifier_rank, int)
            or not 0 <= modifier_rank < dist.world_size()
        ):
            raise ValueError(
                f"GatheredParameters: modifier_rank must be None or an int rank in "
                f"[0, {dist.world_size()}), got {modifier_rank!r}"
            )
        self.enabled = enabled
        self.modifier_rank = modifier_rank
        self.fwd_module = fwd_module
        params = _as_list(params) if enabled else []
        # zero.Init params not gathered already (by an enclosing block, or touched by a
        # constructor under zero.Init): those are the enclosing owner's to write back.
        self.init_params = [
            p
            for p in params
            if partitioned.init_shard(p) is not None
            and p.ds_status is ZeroParamStatus.NOT_AVAILABLE
        ]
        self.by_store: dict[int, tuple] = {}
        self.watched: list = []  # enable_sanity_checks: (param, data_ptr, version) at entry
        self.params = params
        for p in params:
            store = partitioned.store_of(p)
            if store is None:
                continue
            entry = self.by_store.setdefault(id(store), (store, []))
            i = partitioned.slot_of(p)
            if i not in entry[1]:
                entry[1].append(i)

    def __enter__(self) -> None:
        for store, ids in self.by_store.values():  # every rank enters with the same params
            if store.schedule is not None:
                store.schedule.agree_block(ids)
        if self.modifier_rank is not None:  # the edit must land after any pending update
            for store, _ in self.by_store.values():
                store.settle()
        for store, ids in self.by_store.values():
            for i in ids:
                store.pinned[i] += 1
            store.fetch(ids)
        for p in self.init_params:
            p.ds_status = ZeroParamStatus.AVAILABLE  # first: a constructor's TouchMode skips it
            p.data = full_value(p).clone()
        if self.modifier_rank is None and (
            any(s.policy.sanity_checks for s, _ in self.by_store.values())
            or any(getattr(p, "ds_enable_sanity_checks", False) for p in self.init_params)
        ):
            self.watched = [(p, p.data.data_ptr(), p._version) for p in self.params]

    def __exit__(self, *exc) -> None:
        changed = self._changed_in_place() if self.watched else []
        with torch.no_grad():
            for store, ids in self.by_store.values():
                try:
                    if self.modifier_rank is not None:
                        store.write_back(ids, self.modifier_rank)
                finally:  # a refused write-back still unpins and frees the gathered copies
                    for i in ids:
                        store.pinned[i] -= 1
                        store.release(i)
                if self.modifier_rank is None:  # edits are discarded, as in DeepSpeed
                    store.restore([i for i in ids if not store.pinned[i]])
            for p in self.init_params:
                if self.modifier_rank is not None:
                    dist.broadcast(p.data, src=self.modifier_rank)
                    write_back(p, p.data)
                p.data = torch.empty(0, dtype=p.data.dtype, device=p.data.device)
                p.ds_status = ZeroParamStatus.NOT_AVAILABLE
        if changed:
            raise RuntimeError(
                "Detected in-place modification of ZeRO-3 parameters inside GatheredParameters "
                f"with modifier_rank=None ({', '.join(changed[:3])}"
                f"{' and more' if len(changed) > 3 else ''}; the edits were discarded). Use "
                "modifier_rank=<rank> to broadcast updates across ranks "
                "(zero_optimization.enable_sanity_checks)"
            )

    def _changed_in_place(self) -> list[str]:
        """Gathered params changed in place on any rank (a collective: every rank learns it).
        As in DeepSpeed, a change is a new storage or a bumped version counter: a write through
        ``p.data`` (which has its own counter) is not seen."""
        mine = [p for p, ptr, ver in self.watched if p.data.data_ptr() != ptr or p._version != ver]
        flag = torch.tensor([float(bool(mine))], device=dist.default_device())
        dist.all_reduce(flag)  # a sum: > 0 when any rank changed one
        if not flag.item():
            return []
        return [f"{tuple(p.ds_shape)} param" for p in mine] or ["on another rank"]


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Declare that ``module``'s forward reads ``parameter`` though another module owns it, so it
    is fetched with ``module``. (Reads through attribute access are also detected on their own.)"""
    if not isinstance(parameter, torch.nn.Parameter):
        raise ValueError("register_external_parameter: 'parameter' must be a torch.nn.Parameter")
    partitioned.add_external_param(module, parameter)
    store = partitioned.store_of(parameter)
    if store is not None and store.schedule is not None:
        store.schedule.add_external(module, partitioned.slot_of(parameter))


@contextlib.contextmanager
def unwrap_model_for_generation(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """DeepSpeed's ``deepspeed.runtime.zero.unwrap_model_for_generation``: every param of a
    stage-3 ``model`` (an engine or its module) gathered once for the block, and the per-module
    fetch hooks idle, so a ``generate`` loop does no gather per token. Yields ``model``.
    Collective; below stage 3 it only yields."""
    params = list(model.parameters())
    stores = {}
    for p in params:
        store = partitioned.store_of(p)
        if store is not None and store.schedule is not None:
            stores[id(store)] = store
    with GatheredParameters(params):
        for store in stores.values():
            store.schedule.suspended = True
        try:
            yield model
        finally:
            for store in stores.values():
                store.schedule.suspended = False
