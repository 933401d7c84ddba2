"""Which gradient columns of a param the device updates: DeepSpeed's selection.

A column of a 2-D param of shape (rows, cols) is ``param[:, c]``; its importance is the L1 norm
of that column of the step's gradient, summed over the column's contiguous copy (as DeepSpeed
sums its column-major gradient bucket). A 1-D param is updated on the device whole.

Columns are ranked per *fragment*: the piece of the param inside one rank's partition of
DeepSpeed's flat buffer (params in registration order, each 2-D param column-major, the total
padded to a multiple of ``2 * world``, cut into ``world`` equal partitions). A fragment's
candidates are the columns wholly inside it (a column cut by a partition boundary is never
selected); ``max(1, int(n * topk_ratio))`` of its ``n`` candidates are kept. On one rank the
only fragment is the whole param. The selected columns are the fragments' in increasing index
order.

Stage 3 (DeepSpeed's ``engine_stage3.py``): each param is partitioned on its own, stored
transposed (a column is contiguous) and cut into ``world`` slices of ``ceil(numel / world)``
elements (``stage3_candidates``). A column wholly inside one slice is a candidate; the top
``max(1, int(n * topk_ratio))`` of a param's ``n`` candidates are kept, ranked together across
the slices (``select_global``), not per slice.
"""

from __future__ import annotations

import torch

# DeepSpeed's stage 1/2 pads the flat group to a multiple of this times the world size.
PARTITION_ALIGN = 2


def num_selected(cols: int, topk_ratio: float) -> int:
    """DeepSpeed's count: at least one column of a non-empty param."""
    return 0 if cols <= 0 else max(1, int(cols * topk_ratio))


def column_fragments(shapes: list[tuple[int, ...]], world: int) -> list[list[tuple[int, int]]]:
    """Per param (``shapes`` in registration order), the candidate column range ``[c0, c1)`` of
    each of its fragments, in rank order; ``[]`` for a param that is not 2-D. A fragment inside
    one column has no candidates (``c0 == c1``; DeepSpeed 0.19.8 fails on it)."""
    numels = [_numel(s) for s in shapes]
    unit = PARTITION_ALIGN * world
    total = -(-sum(numels) // unit) * unit
    part = total // world
    out, off = [], 0
    for shape, n in zip(shapes, numels):
        frags = []
        if len(shape) == 2:
            rows = shape[0]
            for r in range(world):
                a, b = max(off, r * part), min(off + n, (r + 1) * part)
                if a < b:
                    lo, hi = a - off, b - off
                    c0 = 0 if lo == 0 else (lo - 1) // rows + 1
                    frags.append((c0, max(c0, hi // rows)))
        out.append(frags)
        off += n
    return out


def selected_count(frags: list[tuple[int, int]], topk_ratio: float) -> int:
    """How many columns a 2-D param with these fragments has selected."""
    return sum(num_selected(c1 - c0, topk_ratio) for c0, c1 in frags)


def select_columns(
    grad: torch.Tensor, topk_ratio: float, frags: list[tuple[int, int]] | None = None
) -> torch.Tensor:
    """The sorted indices of the top columns of the 2-D ``grad`` (int64, on its device), per
    fragment (None: the whole param is one)."""
    rows, cols = grad.shape
    per_column = grad.t().contiguous().view(cols, rows).abs().sum(dim=1)
    return select_from_sums(per_column, topk_ratio, frags)


def select_from_sums(
    per_column: torch.Tensor, topk_ratio: float, frags: list[tuple[int, int]] | None = None
) -> torch.Tensor:
    """``select_columns`` from the columns' L1 norms (``per_column``, one per column)."""
    picks = []
    for c0, c1 in frags if frags is not None else [(0, per_column.numel())]:
        k = num_selected(c1 - c0, topk_ratio)
        if k:
            _, top = torch.topk(per_column[c0:c1], k)
            picks.append(top.sort()[0] + c0)
    if not picks:
        return torch.zeros(0, dtype=torch.int64, device=per_column.device)
    return torch.cat(picks) if len(picks) > 1 else picks[0]


def stage3_candidates(shape: tuple[int, ...], world: int) -> list[tuple[int, int]]:
    """Per slice of DeepSpeed's stage-3 partition of a 2-D param (in rank order), its candidate
    column range ``[c0, c1)``; empty (``c0 == c1``) for a slice inside one column (DeepSpeed
    0.19.8 fails on it); a rank whose slice is all padding has none."""
    rows, cols = shape
    numel = rows * cols
    size = -(-numel // world)
    out = []
    for r in range(world):
        start = r * size
        if start >= numel:
            break
        end = min(start + size, numel)
        c0 = -(-start // rows)
        out.append((c0, max(c0, end // rows)))
    return out


def stage3_count(shape: tuple[int, ...], world: int, topk_ratio: float) -> int:
    """How many columns a 2-D param has selected at stage 3."""
    return num_selected(sum(c1 - c0 for c0, c1 in stage3_candidates(shape, world)), topk_ratio)


def select_global(
    per_column: torch.Tensor, topk_ratio: float, ranges: list[tuple[int, int]]
) -> torch.Tensor:
    """The sorted indices of the top ``max(1, int(n * topk_ratio))`` of the ``n`` candidate
    columns in ``ranges``, ranked together (the candidates in increasing column order, as
    DeepSpeed concatenates its ranks' sums); none without candidates."""
    device = per_column.device
    idx = [torch.arange(c0, c1, device=device) for c0, c1 in ranges if c1 > c0]
    if not idx:
        return torch.zeros(0, dtype=torch.int64, device=device)
    cand = torch.cat(idx)
    _, top = torch.topk(per_column[cand], num_selected(cand.numel(), topk_ratio))
    return cand[top].sort()[0]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
