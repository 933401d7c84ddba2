"""Checksums of swap-file blocks: what this run wrote, checked on every read, so contents
changed underneath the run (another process, a bad disk, a stray ``dd``) are an error instead
of master weights or params silently replaced.

A block's sum is the sum of its 512 int64 words, wrapping modulo 2**64 (integer addition is
associative, so the result does not depend on how torch splits the reduction across threads),
one per 4096-byte block, kept per block position. Any change of one word changes it (a nonzero
difference below 2**64), and an overwritten, zeroed, truncated or misplaced block changes it
unless the new words sum to the old ones (for unrelated data, a 1 in 2**64 coincidence); a
reordering of words inside one block is not seen. It is one vectorised reduction over the
buffer in the words' own dtype (~25 GB/s on 2 cores; widening int32 words to int64 first ran at
~1.8 GB/s, slower than the disk it guards), so the check costs far less than the I/O.
"""

from __future__ import annotations

import torch

BLOCK = 4096  # bytes per checksummed block: the swap files' I/O unit


def block_sums(buf: torch.Tensor) -> torch.Tensor:
    """One int64 sum per 4096-byte block of ``buf`` (a uint8 CPU tensor whose length is a
    multiple of 4096)."""
    assert buf.numel() % BLOCK == 0, "checksums cover whole 4096-byte blocks"
    return buf.view(torch.int64).view(-1, BLOCK // 8).sum(1)  # wraps mod 2**64


def first_mismatch(buf: torch.Tensor, want: torch.Tensor, known: torch.Tensor) -> int | None:
    """Index of the first block of ``buf`` whose sum differs from ``want`` where ``known``
    (blocks this run has written), or None."""
    bad = (block_sums(buf) != want) & known
    return int(bad.nonzero()[0]) if bool(bad.any()) else None
