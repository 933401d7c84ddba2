"""Checksums of swap-file blocks: what this run wrote, checked on every read, so contents
changed underneath the run (another process, a bad disk, a stray ``dd``) are an error instead
of master weights or params silently replaced.

A block's sum is ``sum_j w_j * x_j`` over its 1024 int32 words with fixed weights
``1 <= w_j < 2**20``: every product is below 2**51 and the sum below 2**61, so nothing
overflows; a change of any one word changes the sum (``w_j != 0``), and so does a swap of two
words with different weights. It is one vectorised pass (no per-block Python loop).
"""

from __future__ import annotations

import torch

BLOCK = 4096  # bytes per checksummed block: the swap files' I/O unit
_WORDS = BLOCK // 4
_ROWS = 256  # blocks summed at a time (bounds the temporary to 8 MiB)
_WEIGHTS = torch.randint(
    1, 1 << 20, (_WORDS,), generator=torch.Generator().manual_seed(0x5A17), dtype=torch.int64
)


def block_sums(buf: torch.Tensor) -> torch.Tensor:
    """One int64 sum per 4096-byte block of ``buf`` (a uint8 CPU tensor whose length is a
    multiple of 4096)."""
    assert buf.numel() % BLOCK == 0, "checksums cover whole 4096-byte blocks"
    words = buf.view(torch.int32).view(-1, _WORDS)
    out = torch.empty(words.shape[0], dtype=torch.int64)
    for i in range(0, words.shape[0], _ROWS):
        rows = words[i : i + _ROWS].to(torch.int64)
        torch.matmul(rows, _WEIGHTS, out=out[i : i + _ROWS])
    return out


def first_mismatch(buf: torch.Tensor, want: torch.Tensor, known: torch.Tensor) -> int | None:
    """Index of the first block of ``buf`` whose sum differs from ``want`` where ``known``
    (blocks this run has written), or None."""
    bad = (block_sums(buf) != want) & known
    return int(bad.nonzero()[0]) if bool(bad.any()) else None
