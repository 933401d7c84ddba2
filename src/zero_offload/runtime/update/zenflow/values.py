"""Where the device part of a ZenFlow step reads and writes its values, per stage.

- ``ParamValues`` (stages 1-2): every rank's params are whole (views of the flat buffer); the
  device part, the same on every rank, reads and writes ``param[:, columns]`` (a 1-D param: all
  of it) from the selected gradient every rank has (``step_grads.py``).
- ``ShardValues`` (stage 3): params are not materialized. The device part reads and writes the
  elements of the selected columns (a param updated whole: all of it) that this rank's param
  shard holds, from the same elements of its grad shard. Every element is held by exactly one
  rank, so the ranks' updates together are the whole device part and no gradient travels
  (DeepSpeed's stage 3 updates the selected columns of each rank's own partition the same way).
  Values are flat, the held elements in shard order (row-major within a param: on one rank the
  same order as ``param[:, columns]``).
"""

from __future__ import annotations

import itertools

import torch

from ....core import dist
from ....core.streams import Streams
from ..param_home import ParamHome
from .device_adam import ColumnState, read, write

Piece = tuple[int, int, int]  # (offset in the param, offset in the shard, count)


class ParamValues:
    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params

    def read_all(self, columns: list[ColumnState]) -> list[torch.Tensor]:
        """Views of whole params on the device: nothing travels."""
        return [read(p, c) for p, c in zip(self.params, columns)]

    def write_all(self, columns: list[ColumnState], values: list[torch.Tensor]) -> None:
        for p, c, v in zip(self.params, columns, values):
            write(p, c, v)

    def read(self, i: int, c: ColumnState) -> torch.Tensor:
        return read(self.params[i], c)

    def write(self, i: int, c: ColumnState, value: torch.Tensor) -> None:
        write(self.params[i], c, value)

    def begin(self) -> None:
        """Writes into whole params need no ordering: nothing else reads them meanwhile."""

    def end(self) -> None:
        """Every rank wrote the same values: nothing to gather."""


def transfer_all(ts: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``ts`` on ``device`` in one copy, not one per tensor (the device part moves every
    param's values and gradient each micro-step): concatenated, moved, split. Host to device is
    asynchronous (the compute stream orders it); device to host waits for its copy."""
    if all(t.device == device for t in ts):
        return ts
    flat = torch.cat([t.reshape(-1) for t in ts])
    moved = flat.to(device, non_blocking=device.type == "cuda")
    out, at = [], 0
    for t in ts:
        out.append(moved[at : at + t.numel()].view(t.shape))
        at += t.numel()
    return out


def position_dtype(end: int) -> torch.dtype:
    """The dtype of shard positions below ``end``: int32 where they fit (half of int64's
    bytes), else int64."""
    return torch.int32 if end < 2**31 else torch.int64


class ShardValues:
    """``pieces[i]``: the pieces of param ``i`` in this rank's shard; ``whole[i]``: the device
    part updates param ``i`` whole (its columns are None)."""

    def __init__(
        self,
        home: ParamHome,
        pieces: list[list[Piece]],
        shapes: list[tuple[int, ...]],
        whole: list[bool],
        device: torch.device,
        dtype: torch.dtype,
        streams: Streams,
    ) -> None:
        self.home, self.pieces, self.shapes, self.device = home, pieces, shapes, device
        self.dtype, self.streams = dtype, streams
        # The shard positions of the held elements the device part updates (int32 while the
        # shard's positions fit; host, and one copy beside a device shard): every param's in
        # one tensor (a micro-step's gather is one index), ``index[i]`` param i's view of it;
        # set at each selection, once for a whole param.
        end = max((sh + n for ps in pieces for _, sh, n in ps), default=0)
        self.pos_dtype = position_dtype(end)
        self._install([self.index_of(i, None) if w else self._none() for i, w in enumerate(whole)])

    def _none(self) -> torch.Tensor:
        return torch.zeros(0, dtype=self.pos_dtype)

    def _install(self, index: list[torch.Tensor]) -> None:
        self._flat = torch.cat(index) if index else self._none()
        self.index = list(self._flat.split([ix.numel() for ix in index]))
        self._flat_on: torch.Tensor | None = None  # the copy beside a device shard
        sizes = [ix.numel() for ix in index]
        self._starts = [0, *itertools.accumulate(sizes)]

    def select(self, i: int, cols: torch.Tensor | None) -> None:
        """Param ``i``'s device-part elements this rank holds: columns ``cols`` (None: all)."""
        index = list(self.index)
        index[i] = self.index_of(i, cols)
        self._install(index)

    def index_of(self, i: int, cols: torch.Tensor | None) -> torch.Tensor:
        """The shard positions of param ``i``'s elements in columns ``cols`` (None: all; else
        increasing) that this rank holds, row-major. Built from the selected columns of the
        rows each piece covers: the work and the memory are the selected elements', not the
        param's."""
        dt, pos = self.pos_dtype, []
        for at, sh, n in self.pieces[i]:
            if cols is None:
                pos.append(torch.arange(sh, sh + n, dtype=dt))
                continue
            ncols = self.shapes[i][-1]
            rows = torch.arange(at // ncols, (at + n - 1) // ncols + 1, dtype=torch.int64)
            flat = (rows[:, None] * ncols + cols.cpu().to(torch.int64)[None, :]).reshape(-1)
            flat = flat[(flat >= at) & (flat < at + n)]
            pos.append((flat + (sh - at)).to(dt))
        return torch.cat(pos) if pos else torch.zeros(0, dtype=dt)

    def swap(self, index: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every param's positions become ``index``; returns the previous ones (a staged
        selection is undone by swapping them back)."""
        old = self.index
        self._install(index)
        return old

    def _all(self, shard: torch.Tensor) -> torch.Tensor:
        """Every param's positions, in param order, beside ``shard`` (copied there once per
        selection)."""
        if shard.device == self._flat.device:
            return self._flat
        if self._flat_on is None:
            self._flat_on = self._flat.to(shard.device)
        return self._flat_on

    def _shard_index(self, i: int, shard: torch.Tensor) -> torch.Tensor:
        if shard.device == self._flat.device:
            return self.index[i]
        # sliced at each use: ``offload_states`` may move the copy's storage between steps
        return self._all(shard)[self._starts[i] : self._starts[i + 1]]

    def _split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        sizes = [ix.numel() for ix in self.index]
        return list(flat.split(sizes)) if sizes else []

    def parts(self, grad_shard: torch.Tensor) -> list[torch.Tensor]:
        """This micro-step's gradient of each param's held device-part elements: one gather,
        one transfer."""
        held = grad_shard[self._all(grad_shard)]
        return self._split(transfer_all([held], self.device)[0])

    def read_all(self, columns: list[ColumnState]) -> list[torch.Tensor]:
        """Every param's device-part values: from a shard in memory one gather and one
        transfer; through a swap file param by param."""
        shard = self.home.shard_tensor()
        if shard is None:
            return [self.read(i, c) for i, c in enumerate(columns)]
        return self._split(transfer_all([shard[self._all(shard)]], self.device)[0])

    def write_all(self, columns: list[ColumnState], values: list[torch.Tensor]) -> None:
        shard = self.home.shard_tensor()
        if shard is None:
            for i, (c, v) in enumerate(zip(columns, values)):
                self.write(i, c, v)
            return
        flat = torch.cat([v.reshape(-1) for v in values]) if values else None
        if flat is not None and flat.numel():
            (moved,) = transfer_all([flat], shard.device)
            shard[self._all(shard)] = moved.to(shard.dtype)

    def read(self, i: int, c: ColumnState | None = None) -> torch.Tensor:
        shard = self.home.shard_tensor()
        if shard is not None:
            return shard[self._shard_index(i, shard)].to(self.device)
        out = [self.home.read(sh, sh + n)[ix - sh].clone() for sh, n, ix in self._runs(i)]
        if not out:
            return torch.zeros(0, dtype=self.dtype, device=self.device)
        return torch.cat(out).to(self.device)

    def write(self, i: int, c: ColumnState | None, value: torch.Tensor) -> None:
        shard = self.home.shard_tensor()
        if shard is not None:
            shard[self._shard_index(i, shard)] = value.to(shard.device, shard.dtype)
            return
        at = 0
        for sh, n, ix in self._runs(i):  # a swap file: read the piece, put the values, write
            buf = self.home.read(sh, sh + n).clone()
            k = ix.numel()
            buf[ix - sh] = value[at : at + k].to(buf.device, buf.dtype)
            self.home.write(sh, buf)
            at += k

    def _runs(self, i: int):
        """(shard offset, count, positions) of each piece of param ``i`` with held elements."""
        ix = self.index[i]
        for _, sh, n in self.pieces[i]:
            inside = ix[(ix >= sh) & (ix < sh + n)]
            if inside.numel():
                yield sh, n, inside

    def begin(self) -> None:
        self.home.prepare_write()  # nothing still reads the shard values replaced
        # a host update's uploads into a device shard land first (its publish may not have
        # run yet: the device part's ``end`` publishes for both)
        self.streams.wait(None, self.streams.h2d)

    def end(self) -> None:
        self.home.flush()
        self.home.publish()  # gathered copies are stale: the next fetch gathers the new values

    def critic_sums(self, parts: list[torch.Tensor], dtypes: list[torch.dtype]) -> list:
        """Per param the sum of |g| over its selected elements, every rank's held ones added
        (fp32 partial sums, then in ``dtypes[i]``)."""
        sums = torch.stack([g.to(dt).abs().sum().float() for g, dt in zip(parts, dtypes)])
        if dist.world_size() > 1:
            dist.all_reduce(sums)
        return [s.to(dt) for s, dt in zip(sums, dtypes)]

    def device_index(self) -> list[torch.Tensor]:
        """The positions' copies beside a device param shard (optimizer state for
        ``offload_states``: they move with the column moments)."""
        on = self._flat_on
        return [on] if on is not None and on.device == self.device else []

    def nbytes(self) -> tuple[int, int]:
        """(host, device) bytes of the positions."""
        on = self._flat_on
        host = self._flat.numel() * self._flat.element_size()
        return host, 0 if on is None else on.numel() * on.element_size()
