"""Stage 3: the param store. Every rank keeps only its param shard of every 16-bit param; a
module's params are gathered to full size (fetched) just before they are used and freed
(released) after.

Index space: each flat group (trainable optimizer groups, plus one group for every other param of
the module) is laid out with one bucket per fetch unit (``build_unit_layout``: the params a module
owns directly). Rank r's param shard is the r-th slice of every bucket, stored contiguously: the
same coordinates as its grad shard and master shard, so the shard optimizer updates it in place
(``ShardHome``) and one all-gather of a bucket rebuilds that module's params.

A **slot** is one bucket with its gather state. Invariants:
- a param's ``.data`` is a view of its slot's gathered buffer exactly while the slot is AVAILABLE,
  and an empty tensor otherwise (``p.numel() == 0``, ``p.ds_status`` NOT_AVAILABLE);
- ``live`` is the number of gathered elements (AVAILABLE or INFLIGHT slots), ``peak_live`` its
  maximum since the last ``reset_peak``;
- a pinned slot (``GatheredParameters``) and a persistent slot are released only by force
  (``empty_cache``, ``invalidate``); ``invalidate`` (after the shard changed) releases a group's
  other slots, whose next fetch gathers the new values, and gathers its persistent slots again
  at once, so between steps a persistent param is full and current (as DeepSpeed keeps it).

Placement: the shard lives on the device, or in host memory with ``offload_param`` (pinned when
CUDA is present). CUDA: a gather runs on the fetch stream (host-to-device copy of the own slice,
then the all-gather) and records an event; the compute stream waits on that event before the
params are used, and a released buffer is marked in use by the compute stream so the caching
allocator does not hand it to the fetch stream while compute may still read it.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...core import dist, host_memory, partitioned
from ...core.flat_group import FlatGroup
from ...core.labels import FETCH, label
from ...core.pinned_bytes import host_bytes
from ...core.status import ZeroParamStatus
from ...core.streams import Streams, alloc_host, release_pinned_cache
from ...nvme.param_shard import NvmeParams, NvmeParamShard
from .init_partition import InitShard, full_value, next_ds_id


@dataclass(frozen=True)
class Stage3Policy:
    """The stage-3 settings the store and the fetch schedule act on (elements, not bytes)."""

    offload_param: bool = False
    pin_memory: bool = True
    prefetch_bucket_size: int = 50_000_000
    param_persistence_threshold: int = 100_000
    model_persistence_threshold: int = 2**63 - 1
    max_live_parameters: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000
    sanity_checks: bool = False  # enable_sanity_checks: cross-rank checks every step

    @classmethod
    def from_config(cls, zc, params: str) -> Stage3Policy:
        """``params``: the placement of the param shard (``Placement.params``)."""
        op = zc.offload_param
        return cls(
            offload_param=params != "device",
            pin_memory=bool(op.pin_memory) if op is not None else True,
            prefetch_bucket_size=int(zc.stage3_prefetch_bucket_size),
            param_persistence_threshold=int(zc.stage3_param_persistence_threshold),
            model_persistence_threshold=int(zc.stage3_model_persistence_threshold),
            max_live_parameters=int(zc.stage3_max_live_parameters),
            max_reuse_distance=int(zc.stage3_max_reuse_distance),
            sanity_checks=bool(zc.enable_sanity_checks),
        )


class Slot:
    """One fetch unit's bucket of one group, and its gather state."""

    __slots__ = (
        "index",
        "group",
        "bucket",
        "params",
        "views",
        "numel",
        "status",
        "buf",
        "work",
        "event",
        "persistent",
        "trainable",
        "label",
    )

    def __init__(self, index: int, group: FlatGroup, bucket, trainable: bool) -> None:
        self.index, self.group, self.bucket, self.trainable = index, group, bucket, trainable
        self.params = [group.params[i] for i in bucket.params]
        names = [group.names[i] for i in bucket.params]
        more = f" and {len(names) - 2} more" if len(names) > 2 else ""
        self.label = f"stage-3 gather of {', '.join(names[:2])}{more}"
        # (offset inside the bucket, numel, shape) of each param's full view
        self.views = [
            (group.layout.offsets[i] - bucket.start, p.ds_numel, p.ds_shape)
            for i, p in zip(bucket.params, self.params)
        ]
        self.numel = bucket.numel
        self.status = ZeroParamStatus.NOT_AVAILABLE
        self.buf: torch.Tensor | None = None
        self.work = None
        self.event = None
        self.persistent = False


class ParamStore:
    # CUDA: event after the last persistent gather's copies out of a host shard (queued
    # without blocking the host); ``quiesce`` waits for it before the shard is rewritten.
    _persistent_read = None

    def __init__(
        self,
        groups: list[FlatGroup],
        trainable: list[bool],
        policy: Stage3Policy,
        streams: Streams,
        device: torch.device,
        nvme: NvmeParams | None = None,
    ) -> None:
        """``nvme``: the param shards live in swap files (``offload_param`` "nvme")."""
        self.groups, self.policy, self.streams, self.device = groups, policy, streams, device
        self.rank, self.world = dist.rank(), dist.world_size()
        pin = policy.pin_memory and device.type == "cuda"
        self.nvme = nvme
        self.read_depth = nvme.depth if nvme is not None else 0  # slots read ahead (NVMe)
        # Per group: the shard tensor (device or host memory), or None when it is on NVMe
        self.shards: list[torch.Tensor | None] = []
        self.swapped: dict[int, NvmeParamShard] = {}  # group index -> its NVMe shard
        self.slots: list[Slot] = []
        self.group_slots: list[list[int]] = []
        # A written-back range (shard start, values) of trainable group ``gi``'s shard: the
        # optimizer group's fp32 master takes it too (the assembly sets it).
        self.edit_master: Callable[[int, int, torch.Tensor], None] = lambda gi, lo, src: None
        # Applies any pending (delayed) update to the shards and masters; the engine sets it.
        # Invariant: called before a write_back's slots are fetched, so no host pass writes the
        # masters concurrently and no staged update lands on the written values afterwards.
        self.settle: Callable[[], None] = lambda: None
        self._empties: dict[torch.dtype, torch.Tensor] = {}
        persistent_left = policy.model_persistence_threshold
        for gi, g in enumerate(groups):
            assert g.index == gi, "store groups are indexed by position"
            numel = g.layout.shard_numel
            if nvme is not None:  # the file is preallocated zeros: padding stays zero
                self.swapped[gi] = nvme.shard(f"group{gi}", numel, g.dtype, pin)
                shard = None
            elif policy.offload_param:
                shard = alloc_host(numel, g.dtype, pin).zero_()  # padding stays zero
            else:
                shard = torch.zeros(numel, dtype=g.dtype, device=device)
            self.shards.append(shard)
            self._partition(g)
            ids = []
            for b in g.layout.buckets:
                slot = Slot(len(self.slots), g, b, trainable[gi])
                data = sum(p.ds_numel for p in slot.params)
                if data <= policy.param_persistence_threshold and data <= persistent_left:
                    slot.persistent = True
                    persistent_left -= data
                for p in slot.params:
                    partitioned.set_slot(p, slot.index)
                    p.ds_persist = slot.persistent  # DeepSpeed's name: stays gathered
                ids.append(slot.index)
                self.slots.append(slot)
            self.group_slots.append(ids)
        if device.type == "cuda":  # zero.Init's pinned chunks were copied in and dropped
            release_pinned_cache()
        self.live = 0
        self.peak_live = 0
        self.pinned: collections.Counter = collections.Counter()
        self.schedule = None  # the FetchSchedule acting on this store, once built

    # ---- construction --------------------------------------------------------------------------
    def _partition(self, g: FlatGroup) -> None:
        """Copy this rank's ranges of every param into the shard, one param at a time, then empty
        the params and give them DeepSpeed's attributes."""
        layout, r = g.layout, self.rank
        bucket_of = layout.param_bucket()
        with torch.no_grad():
            for i, p in enumerate(g.params):
                b = layout.buckets[bucket_of[i]]
                lo_own = b.start + r * b.slice_numel
                off, n = layout.offsets[i], layout.numels[i]
                lo, hi = max(off, lo_own), min(off + n, lo_own + b.slice_numel)
                value = full_value(p)
                shape = tuple(value.shape)
                start = b.shard_start + max(lo - lo_own, 0)
                piece = value.reshape(-1)[lo - off : hi - off] if hi > lo else value[:0]
                self.shard_write(g.index, start, piece.reshape(-1))
                n_own = max(hi - lo, 0)
                shard = self.shards[g.index]
                # DeepSpeed's ds_tensor: this rank's piece (on NVMe: its size only, no memory)
                dst = (
                    shard[start : start + n_own]
                    if shard is not None
                    else torch.empty(n_own, dtype=g.dtype, device="meta")
                )
                partitioned.clear_init_shard(p)
                if hasattr(p, "ds_tensor"):
                    del p.ds_tensor
                p.ds_numel = n
                p.ds_shape = torch.Size(shape)
                p.ds_tensor = dst  # this rank's piece of the param (may be empty)
                if not hasattr(p, "ds_id"):
                    p.ds_id = next_ds_id()
                p.ds_status = ZeroParamStatus.NOT_AVAILABLE
                partitioned.attach_store(p, self)
                p.data = self._empty(g.dtype)

    # ---- gather / release ----------------------------------------------------------------------
    def start(self, i: int) -> None:
        """Begin gathering slot ``i`` (asynchronously where the backend allows)."""
        slot = self.slots[i]
        if slot.status is not ZeroParamStatus.NOT_AVAILABLE:
            return
        b = slot.bucket
        src = self._read_own(slot)
        st = self.streams
        st.wait(st.fetch, None)  # the own slice may be rewritten only after compute is done
        with label(FETCH), st.use(st.fetch):
            # On a CPU a mapping of its own, unmapped at release: freed gathers would otherwise
            # stay in malloc's heap as free heap (core/host_memory.py)
            buf = host_memory.empty(b.numel, slot.group.dtype, self.device)
            own = self._own_slice(slot, buf)
            own.copy_(src, non_blocking=st.cuda)
            slot.work = dist.all_gather(
                buf, own, async_op=self.world > 1 and not st.cuda, what=slot.label
            )
            slot.event = st.record(st.fetch)
        slot.buf = buf
        slot.status = ZeroParamStatus.INFLIGHT
        self._set_status(slot, ZeroParamStatus.INFLIGHT)
        self.live += slot.numel
        self.peak_live = max(self.peak_live, self.live)

    def wait(self, i: int) -> None:
        """Slot ``i`` is gathered and its params bound to the full views."""
        slot = self.slots[i]
        if slot.status is ZeroParamStatus.NOT_AVAILABLE:
            self.start(i)
        if slot.status is ZeroParamStatus.AVAILABLE:
            return
        if slot.work is not None:
            slot.work.wait()
            slot.work = None
        if slot.event is not None:
            torch.cuda.current_stream().wait_event(slot.event)
            slot.event = None
        self._bind(slot, slot.buf)
        slot.status = ZeroParamStatus.AVAILABLE
        self._set_status(slot, ZeroParamStatus.AVAILABLE)

    def fetch(self, ids) -> None:
        """Gather the slots ``ids`` (all collectives started before the first wait)."""
        for i in ids:
            self.start(i)
        for i in ids:
            self.wait(i)

    def release(self, i: int, force: bool = False) -> None:
        """Free slot ``i``'s full params (persistent and pinned ones only with ``force``)."""
        slot = self.slots[i]
        if slot.status is ZeroParamStatus.NOT_AVAILABLE:
            return
        if not force and (slot.persistent or self.pinned[i]):
            return
        if slot.status is ZeroParamStatus.INFLIGHT:
            self.wait(i)
        for p in slot.params:
            p.data = self._empty(slot.group.dtype)
        self.streams.keep_alive(
            slot.buf, torch.cuda.current_stream() if self.streams.cuda else None
        )
        slot.buf = None
        slot.status = ZeroParamStatus.NOT_AVAILABLE
        self._set_status(slot, ZeroParamStatus.NOT_AVAILABLE)
        self.live -= slot.numel

    def release_all(self, force: bool = False) -> None:
        for i in range(len(self.slots)):
            self.release(i, force=force)

    def empty_cache(self) -> None:
        """Release every gathered slot, persistent ones too, except those a
        ``GatheredParameters`` block holds (DeepSpeed's ``empty_partition_cache``)."""
        self.quiesce()
        for i in range(len(self.slots)):
            if not self.pinned[i]:
                self.release(i, force=True)

    def quiesce(self) -> None:
        """Every gather started so far has finished reading the shards (before they change)."""
        for slot in self.slots:
            if slot.status is ZeroParamStatus.INFLIGHT:
                self.wait(slot.index)
        if self.streams.cuda:
            self.streams.fetch.synchronize()
            if self._persistent_read is not None:
                self._persistent_read.synchronize()
                self._persistent_read = None

    def invalidate(self, gi: int) -> None:
        """Group ``gi``'s shard changed: drop every gathered copy but the persistent ones, which
        take the new values at once (a collective: every rank invalidates the same groups in
        the same order, as the step and a checkpoint load do)."""
        for i in self.group_slots[gi]:
            if not self.slots[i].persistent:
                self.release(i, force=True)
        self.refresh_persistent(gi)

    def refresh_persistent(self, gi: int, missing_only: bool = False) -> None:
        """Every persistent slot of group ``gi`` (``missing_only``: those not gathered) is
        gathered from the shard as it is now, in one all-gather of their own slices side by
        side. Invariant kept: from the first shard change on, a persistent slot is gathered and
        equal to the shard between steps (DeepSpeed's ``persistent_parameters``)."""
        slots = [self.slots[i] for i in self.group_slots[gi] if self.slots[i].persistent]
        if missing_only:
            slots = [s for s in slots if s.status is ZeroParamStatus.NOT_AVAILABLE]
        if not slots:
            return
        with label(FETCH):  # a fetch too: profiles and traces name it as one
            self._gather_persistent_slots(gi, slots)

    def _gather_persistent_slots(self, gi: int, slots: list) -> None:
        for s in slots:
            self.release(s.index, force=True)
        g = self.groups[gi]
        own = host_memory.empty(sum(s.bucket.slice_numel for s in slots), g.dtype, self.device)
        # A host shard (the store's own memory, pinned with CUDA) is read without blocking the
        # host: one queued copy per slot instead of one synchronous copy each; the event keeps
        # the shard from being rewritten before they land. An NVMe read's buffer is temporary,
        # so that copy stays synchronous.
        host = self.streams.cuda and self.shards[gi] is not None and self.shards[gi].is_cpu
        at = 0
        for s in slots:  # each slot's own slice straight into the send buffer (one copy)
            n = s.bucket.slice_numel
            own[at : at + n].copy_(self._read_own(s, cache=False), non_blocking=host)
            at += n
        if host:
            self._persistent_read = self.streams.record()
        out = host_memory.empty(self.world * own.numel(), g.dtype, self.device)
        dist.all_gather(out, own, what=f"stage-3 gather of group {gi}'s persistent params")
        ranks, at = out.view(self.world, -1), 0  # row r: rank r's slices, slot after slot
        for s in slots:
            n = s.bucket.slice_numel
            s.buf = host_memory.empty(s.numel, g.dtype, self.device)
            s.buf.view(self.world, n).copy_(ranks[:, at : at + n])
            at += n
            self._bind(s, s.buf)
            s.status = ZeroParamStatus.AVAILABLE
            self._set_status(s, ZeroParamStatus.AVAILABLE)
            self.live += s.numel
        self.peak_live = max(self.peak_live, self.live)

    def gather_persistent(self) -> None:
        """Every persistent slot not gathered now is gathered (one all-gather per group that
        has any). A collective after every optimizer step (DeepSpeed's ``_post_step``): ranks
        agree on which slots are gathered, as they run the same fetches and releases."""
        for gi in range(len(self.groups)):
            self.refresh_persistent(gi, missing_only=True)

    # ---- the param shards, wherever they live --------------------------------------------------
    def shard_read(self, gi: int, lo: int, hi: int, cache: bool = True) -> torch.Tensor:
        """Elements [lo, hi) of group ``gi``'s param shard: a view, or read from NVMe (kept in
        its cache for the fetches, unless ``cache`` is false)."""
        shard = self.shards[gi]
        return shard[lo:hi] if shard is not None else self.swapped[gi].read(lo, hi, cache)

    def shard_write(self, gi: int, lo: int, src: torch.Tensor, non_blocking: bool = False) -> None:
        """Elements [lo, lo + src.numel()) of group ``gi``'s param shard take ``src``."""
        shard = self.shards[gi]
        if shard is None:
            self.swapped[gi].write(lo, src)
        else:
            shard[lo : lo + src.numel()].copy_(src, non_blocking=non_blocking)

    def read_ahead(self, ids) -> None:
        """NVMe: start reading the own slices of slots ``ids`` (the next ones to be fetched)."""
        for i in ids:
            slot = self.slots[i]
            nv = self.swapped.get(slot.group.index)
            if nv is not None and slot.status is ZeroParamStatus.NOT_AVAILABLE:
                b = slot.bucket
                nv.read_ahead(b.shard_start, b.shard_start + b.slice_numel)

    def _read_own(self, slot: Slot, cache: bool = True) -> torch.Tensor:
        """This rank's piece of the slot in its param shard."""
        b = slot.bucket
        lo, hi = b.shard_start, b.shard_start + b.slice_numel
        return self.shard_read(slot.group.index, lo, hi, cache)

    def _write_own(self, slot: Slot, src: torch.Tensor) -> None:
        self.shard_write(slot.group.index, slot.bucket.shard_start, src)

    def _own_slice(self, slot: Slot, buf: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a full bucket buffer (where its shard goes in the all-gather)."""
        n = slot.bucket.slice_numel
        return buf[self.rank * n : (self.rank + 1) * n]

    def _empty(self, dtype: torch.dtype) -> torch.Tensor:
        """The one zero-element tensor per dtype that released params point at: no allocation
        per param per release (zero elements, so sharing it ties nothing together)."""
        t = self._empties.get(dtype)
        if t is None:
            t = self._empties[dtype] = torch.empty(0, dtype=dtype, device=self.device)
        return t

    @staticmethod
    def _set_status(slot: Slot, status: ZeroParamStatus) -> None:
        for p in slot.params:
            p.ds_status = status

    # ---- edits of full params (GatheredParameters with a modifier rank) ------------------------
    def write_back(self, ids, src_rank: int) -> None:
        """Every rank takes rank ``src_rank``'s full values of the gathered slots ``ids`` into its
        param shard (and its fp32 master shard, for trainable groups). A param whose ``.data``
        was replaced inside the block counts by its new value; a new shape is refused on every
        rank (the shards and the master keep the param's size)."""
        with torch.no_grad():
            self._adopt_replaced_data(ids)
            for i in ids:
                slot = self.slots[i]
                self.wait(i)
                dist.broadcast(slot.buf, src=src_rank)
                own = self._own_slice(slot, slot.buf)
                self._write_own(slot, own)
                if slot.trainable:
                    self.edit_master(slot.group.index, slot.bucket.shard_start, own)

    def _adopt_replaced_data(self, ids) -> None:
        problems = []
        for i in ids:
            slot = self.slots[i]
            self.wait(i)
            for p, (off, n, shape) in zip(slot.params, slot.views):
                view = slot.buf[off : off + n]
                if p.data.data_ptr() == view.data_ptr() and tuple(p.shape) == tuple(shape):
                    continue
                if tuple(p.shape) != tuple(shape):
                    problems.append(f"shape {list(p.shape)} instead of {list(shape)}")
                else:
                    view.copy_(p.data.reshape(-1))  # .data = new tensor: its values are the edit
        flag = torch.tensor([1 if problems else 0], dtype=torch.int32, device=self.device)
        if self.world > 1:
            dist.all_reduce(flag)
        if int(flag):  # every rank raises, so no rank waits in a broadcast alone
            mine = f" (here: a param got {problems[0]})" if problems else ""
            raise ValueError(
                "GatheredParameters(modifier_rank=...): a param's .data was given a new shape "
                f"inside the block{mine}; a partitioned param keeps its size (its shards and "
                "fp32 master are laid out for it): write values in place, or rebuild the model "
                "before initialize()"
            )

    def restore(self, ids) -> None:
        """Slots ``ids`` that stayed gathered (persistent, or in use by a running module) take
        their values from the shards again, dropping any edit made to the gathered copy. A
        collective when any slot is gathered; every rank has the same ones."""
        again = [i for i in ids if self.slots[i].status is not ZeroParamStatus.NOT_AVAILABLE]
        for i in again:
            self.release(i, force=True)
        self.fetch(again)

    def release_to_init_form(self) -> None:
        """The engine is destroyed: every param leaves this store as a ``zero.Init`` param
        (its even chunk as ``ds_tensor``), so the model stays partitioned without the store and a
        later engine lays it out again. A collective (one slot gathered at a time)."""
        self.quiesce()
        # the chunks stay where the shards were; shards on NVMe (gone with the store): host
        first = self.shards[0] if self.shards else None
        where = first.device if first is not None else torch.device("cpu")
        for slot in self.slots:
            self.wait(slot.index)
            for p, (off, n, shape) in zip(slot.params, slot.views):
                spec = InitShard(n, tuple(shape), self.world, self.rank)
                p.ds_tensor = slot.buf[off + spec.lo : off + spec.hi].to(where, copy=True)
                partitioned.set_init_shard(p, spec)
                partitioned.detach_store(p)
                for attr in ("ds_z3_leaf_module", "ds_persist"):
                    if hasattr(p, attr):
                        delattr(p, attr)
            self.release(slot.index, force=True)
            self._set_status(slot, ZeroParamStatus.NOT_AVAILABLE)
        self.pinned.clear()

    # ---- whole-model access (checkpoints) -------------------------------------------------------
    @contextlib.contextmanager
    def params_on_host(self, write_back: bool = False):
        """Every param bound to a full copy in host memory while the block runs (a collective;
        one slot on the device at a time). With ``write_back``, on a clean exit each rank's
        param shard takes its own slice of the (possibly edited) host copy. Within the block a
        param's ``ds_status`` is not what its ``.data`` holds; nothing may fetch or step."""
        self.quiesce()
        copies = []
        try:
            for slot in self.slots:
                was_available = slot.status is ZeroParamStatus.AVAILABLE
                self.wait(slot.index)
                host = slot.buf.to("cpu", copy=True)
                if not was_available:
                    self.release(slot.index, force=True)
                self._bind(slot, host)
                copies.append(host)
            yield
            if write_back:
                for slot, host in zip(self.slots, copies):
                    self._write_own(slot, self._own_slice(slot, host))
                    if slot.status is ZeroParamStatus.AVAILABLE:
                        slot.buf.copy_(host)
                self.gather_persistent()  # the shards changed (gathered ones took the copy)
        finally:
            for slot in self.slots[: len(copies)]:
                if slot.status is ZeroParamStatus.AVAILABLE:
                    self._bind(slot, slot.buf)
                else:
                    for p in slot.params:
                        p.data = self._empty(slot.group.dtype)

    @staticmethod
    def _bind(slot: Slot, buf: torch.Tensor) -> None:
        for p, (off, n, shape) in zip(slot.params, slot.views):
            p.data = buf[off : off + n].view(shape)

    # ---- reporting -----------------------------------------------------------------------------
    def reset_peak(self) -> None:
        """The peaks (gathered elements, the NVMe param cache) start again from what is held."""
        self.peak_live = self.live
        if self.nvme is not None:
            self.nvme.cache.reset_peak()

    def nbytes(self) -> dict[str, int]:
        where = "nvme" if self.swapped else "host" if self.policy.offload_param else "device"
        out: dict[str, int] = {}
        for gi, g in enumerate(self.groups):
            key = f"{where}.param_shard" if self.trainable(gi) else f"{where}.frozen_param_shard"
            shard = self.shards[gi] if where == "host" and gi < len(self.shards) else None
            held = g.layout.shard_numel * g.dtype.itemsize  # pinned: what the buffer reserves
            out[key] = out.get(key, 0) + (host_bytes(shard) if shard is not None else held)
        for nv in self.swapped.values():
            for k, v in nv.nbytes().items():
                out[k] = out.get(k, 0) + v
        # the persistent slots gathered (held between steps) apart from the others (working set)
        held = [
            s for s in self.slots if s.persistent and s.status is not ZeroParamStatus.NOT_AVAILABLE
        ]
        if held:
            out["device.persistent_params"] = sum(s.numel * s.group.dtype.itemsize for s in held)
        others = self.live - sum(s.numel for s in held)
        if others:
            esize = self.groups[0].dtype.itemsize if self.groups else 0
            out["device.gathered_params"] = others * esize
        if self.swapped and self.nvme is not None:  # the whole model's NVMe read/write buffers
            out["peak.host.param_buffers"] = self.nvme.cache.peak_bytes
        return out

    def persistent_bytes(self) -> int:
        """What the persistent slots hold once gathered (from the first step on)."""
        return sum(s.numel * s.group.dtype.itemsize for s in self.slots if s.persistent)

    def trainable(self, gi: int) -> bool:
        return bool(self.group_slots[gi]) and self.slots[self.group_slots[gi][0]].trainable


class ShardHome:
    """The shard optimizer's view of one trainable group's param shard (see param_home.py)."""

    def __init__(self, store: ParamStore, gi: int) -> None:
        self.store, self.gi = store, gi
        swapped, offloaded = gi in store.swapped, store.policy.offload_param
        self.where = "nvme" if swapped else "host" if offloaded else "device"

    def read(self, lo: int, hi: int) -> torch.Tensor:
        return self.store.shard_read(self.gi, lo, hi, cache=False)  # the master's copy

    def write(self, lo: int, src: torch.Tensor, non_blocking: bool = False) -> None:
        self.store.shard_write(self.gi, lo, src, non_blocking)

    def host_shard(self) -> torch.Tensor | None:
        return self.store.shards[self.gi] if self.where == "host" else None

    def write_target(self, lo: int, hi: int) -> torch.Tensor | None:
        nv = self.store.swapped.get(self.gi)
        return None if nv is None else nv.write_target(lo, hi)

    def finish_write(self) -> None:
        self.store.swapped[self.gi].finish_write()

    def shard_views(self, segs) -> list[torch.Tensor]:
        shard = self.shard_tensor()
        assert shard is not None, "a param shard in device or host memory only"
        return [shard[s.shard_start : s.shard_start + s.numel] for s in segs]

    def shard_tensor(self) -> torch.Tensor | None:
        """The param shard in device or host memory: stored contiguously in shard order."""
        return self.store.shards[self.gi] if self.where in ("device", "host") else None

    def prepare_write(self) -> None:
        self.store.quiesce()

    def flush(self) -> None:
        nv = self.store.swapped.get(self.gi)
        if nv is not None:
            nv.flush()

    def device_params(self) -> tuple[torch.Tensor, str] | None:
        shard = self.store.shards[self.gi]  # None on NVMe
        on_device = shard is not None and shard.device == self.store.device
        return (shard, "device.param_shard") if on_device else None

    def publish(self) -> None:
        st = self.store.streams
        st.wait(None, st.h2d)  # uploads into a device shard land before anything gathers it
        self.store.invalidate(self.gi)
