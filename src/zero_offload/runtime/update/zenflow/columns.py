"""Which gradient columns of a param the device updates: DeepSpeed's selection.

A column of a 2-D param of shape (rows, cols) is ``param[:, c]``; its importance is the L1 norm
of that column of the step's gradient, summed over the column's contiguous copy (as DeepSpeed
sums its column-major gradient bucket). ``max(1, int(cols * topk_ratio))`` columns are kept,
in increasing index order. A 1-D param is updated on the device whole.
"""

from __future__ import annotations

import torch


def num_selected(cols: int, topk_ratio: float) -> int:
    """DeepSpeed's count: at least one column of a non-empty param."""
    return 0 if cols == 0 else max(1, int(cols * topk_ratio))


def select_columns(grad: torch.Tensor, topk_ratio: float) -> torch.Tensor:
    """The sorted indices of the top columns of the 2-D ``grad`` (int64, on its device)."""
    rows, cols = grad.shape
    per_column = grad.t().contiguous().view(cols, rows).abs().sum(dim=1)
    _, top = torch.topk(per_column, num_selected(cols, topk_ratio))
    return top.sort()[0]
