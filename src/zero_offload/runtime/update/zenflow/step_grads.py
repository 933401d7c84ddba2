"""This micro-step's reduced gradient as ZenFlow's two parts read it.

The parts need, per param: the L1 norm of each column of a 2-D param (at a selection), the
selected columns' gradient of a 2-D param and the whole gradient of a 1-D param (the device part,
every micro-step), and the sum of |g| of a 2-D param ("auto").

- ``ShardGrads`` (one rank): the host grad shard is the whole flat group; every answer is a view
  or a reduction of it.
- ``RankGrads`` (several ranks): a rank holds only its shard. Each answer is assembled on the host
  from the pieces of each param this rank holds, the rest left zero, and all-reduced on the
  device: every element is held by exactly one rank, so the selected and 1-D gradients arrive
  exact, and the column and |g| sums are sums of the ranks' partial sums. Only the selected
  columns and the 1-D params travel (a ``topk_ratio`` fraction of the gradient), never the whole
  gradient. Invariant: every rank gets the same values (one all-reduce), so the device part,
  replicated on every rank, stays identical across ranks.
"""

from __future__ import annotations

import torch

from ....core import dist
from ....core.pinned_bytes import host_bytes
from ....core.streams import alloc_host

Piece = tuple[int, int, int]  # (offset in the param, offset in the shard, count)


class ShardGrads:
    """One rank: param ``i``'s gradient is ``shard[lo:hi]`` in its shape."""

    def __init__(self, ranges: list[tuple[int, int]], shapes: list[torch.Size]) -> None:
        self.ranges, self.shapes = ranges, shapes
        self.shard: torch.Tensor | None = None

    def bind(self, shard: torch.Tensor) -> None:
        self.shard = shard

    def grad(self, i: int) -> torch.Tensor:
        lo, hi = self.ranges[i]
        return self.shard[lo:hi].view(self.shapes[i])

    def column_sums(self) -> list[torch.Tensor | None]:
        """Per 2-D param the L1 norm of each column (None for a 1-D param), summed over the
        column's contiguous copy (as DeepSpeed sums its column-major gradient bucket)."""
        out = []
        for i, shape in enumerate(self.shapes):
            if len(shape) != 2:
                out.append(None)
                continue
            rows, cols = shape
            out.append(self.grad(i).t().contiguous().view(cols, rows).abs().sum(dim=1))
        return out

    def parts(self, columns: list[torch.Tensor | None]) -> list[torch.Tensor]:
        """Per param the device part's gradient: ``g[:, columns]``, or ``g`` for a 1-D param."""
        out = []
        for i, cols in enumerate(columns):
            g = self.grad(i)
            out.append(g if cols is None else g[:, cols.to(g.device)])
        return out

    def abs_sums(self, dtypes: list[torch.dtype]) -> list[torch.Tensor | None]:
        """Per 2-D param the sum of |g| with ``g`` in ``dtypes[i]`` (None for a 1-D param)."""
        return [
            self.grad(i).to(dt).abs().sum() if len(s) == 2 else None
            for i, (s, dt) in enumerate(zip(self.shapes, dtypes))
        ]

    def nbytes(self) -> int:
        return 0

    def host_nbytes(self) -> int:
        return 0

    def buffers(self) -> list[torch.Tensor]:
        return []


class RankGrads:
    """Several ranks: ``pieces[i]`` are the pieces of param ``i`` this rank's shard holds;
    ``counts[i]`` the number of selected columns of a 2-D param (fixed by its fragments)."""

    def __init__(
        self,
        pieces: list[list[Piece]],
        shapes: list[torch.Size],
        counts: list[int],
        dtype: torch.dtype,
        device: torch.device,
        parts: bool = True,
    ) -> None:
        """``parts``: ``parts()`` is used (stages 1-2; stage 3 reads its own shard)."""
        self.pieces, self.shapes = pieces, shapes
        self.sizes = [s[0] * k if len(s) == 2 else s.numel() for s, k in zip(shapes, counts)]
        ncols = sum(s[1] for s in shapes if len(s) == 2)
        # the device buffers the all-reduces run in: rewritten whole by every use
        self.packed = torch.zeros(sum(self.sizes) if parts else 0, dtype=dtype, device=device)
        # where ``parts`` assembles each step's pieces: pinned beside a GPU so the upload is
        # asynchronous; refilled only after the last upload from it ran (``_uploaded``)
        cuda = device.type == "cuda"
        self.staging = alloc_host(self.packed.numel(), dtype, cuda)
        self._uploaded = None
        # fp32: the ranks' partial column norms are added unrounded, and the whole norm is
        # rounded once to the gradient's dtype, as a single sum over the column rounds it
        self.colsums = torch.zeros(ncols, dtype=torch.float32, device=device)
        self.dtype = dtype
        self.shard: torch.Tensor | None = None

    def bind(self, shard: torch.Tensor) -> None:
        self.shard = shard

    def _rows(self, i: int):
        """(row, first column, values) of each run of whole or partial rows of param ``i`` this
        rank holds: a partial first row, the whole rows (values shaped (n, cols)), a partial
        last row."""
        cols = self.shapes[i][1]
        for at, sh, n in self.pieces[i]:
            vals = self.shard[sh : sh + n]
            row, c0 = divmod(at, cols)
            if c0:
                m = min(cols - c0, n)
                yield row, c0, vals[:m]
                vals, row, n = vals[m:], row + 1, n - m
            whole = n // cols
            if whole:
                yield row, 0, vals[: whole * cols].view(whole, cols)
            if n % cols:
                yield row + whole, 0, vals[whole * cols :]

    def column_sums(self) -> list[torch.Tensor | None]:
        host = torch.zeros(self.colsums.numel(), dtype=torch.float32)
        out, at = [], 0
        for i, shape in enumerate(self.shapes):
            if len(shape) != 2:
                out.append(None)
                continue
            mine = host[at : at + shape[1]]
            for _, c0, vals in self._rows(i):
                if vals.dim() == 2:
                    mine += vals.abs().sum(dim=0, dtype=torch.float32)
                else:
                    mine[c0 : c0 + vals.numel()] += vals.abs().float()
            out.append((at, shape[1]))
            at += shape[1]
        self._reduce(self.colsums, host)
        sums = self.colsums.to(self.dtype)
        return [None if o is None else sums[o[0] : o[0] + o[1]] for o in out]

    def parts(self, columns: list[torch.Tensor | None]) -> list[torch.Tensor]:
        if self._uploaded is not None:
            self._uploaded.synchronize()
        host = self.staging.zero_()
        spans, at = [], 0
        for i, (shape, cols) in enumerate(zip(self.shapes, columns)):
            size = self.sizes[i]
            assert cols is not None or len(shape) == 1, "a 2-D param's columns are chosen first"
            if cols is None:  # a 1-D param: whole
                for off, sh, n in self.pieces[i]:
                    host[at + off : at + off + n] = self.shard[sh : sh + n]
                spans.append((at, (size,)))
            else:
                self._fill_columns(i, cols.cpu(), host[at : at + size].view(shape[0], -1))
                spans.append((at, (shape[0], size // shape[0])))
            at += size
        self._reduce(self.packed, host)
        if self.packed.is_cuda:
            self._uploaded = torch.cuda.Event()
            self._uploaded.record()
        return [self.packed[a : a + int(torch.Size(s).numel())].view(s) for a, s in spans]

    def _fill_columns(self, i: int, cols: torch.Tensor, out: torch.Tensor) -> None:
        """``out[r, j] = g[r, cols[j]]`` for the elements of param ``i`` this rank holds."""
        pos = torch.full((self.shapes[i][1],), -1, dtype=torch.long)
        pos[cols] = torch.arange(cols.numel())
        for row, c0, vals in self._rows(i):
            if vals.dim() == 2:
                out[row : row + vals.shape[0]] = vals[:, cols]
                continue
            j = pos[c0 : c0 + vals.numel()]
            keep = j >= 0
            out[row, j[keep]] = vals[keep]

    def abs_sums(self, dtypes: list[torch.dtype]) -> list[torch.Tensor | None]:
        """Per 2-D param the ranks' partial sums of |g| (fp32), added, in ``dtypes[i]``."""
        idx = [i for i, s in enumerate(self.shapes) if len(s) == 2]
        host = torch.zeros(len(idx), dtype=torch.float32)
        for j, i in enumerate(idx):
            for _, sh, n in self.pieces[i]:
                host[j] += self.shard[sh : sh + n].to(dtypes[i]).abs().sum().float()
        sums = host.to(self.packed.device)
        dist.all_reduce(sums)
        out: list[torch.Tensor | None] = [None] * len(self.shapes)
        for j, i in enumerate(idx):
            out[i] = sums[j].to(dtypes[i])  # on the device, beside the selected part
        return out

    def _reduce(self, dev: torch.Tensor, host: torch.Tensor) -> None:
        dev.copy_(host, non_blocking=host.is_pinned())
        dist.all_reduce(dev)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def host_nbytes(self) -> int:
        """The staging's bytes (as the pinned allocator holds them)."""
        return host_bytes(self.staging)

    def buffers(self) -> list[torch.Tensor]:
        return [self.packed, self.colsums]
