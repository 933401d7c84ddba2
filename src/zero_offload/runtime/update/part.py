"""A part of a group's shard that one update owns: the twin update (``twin_update.py``) gives its
device part ``[0, cut)`` and its host part ``[cut, numel)`` each to an update of its own.

An update over a ``Span`` works in the span's own coordinates (shard index minus ``lo``): its
state, its chunks, its segments and its param home (``PartHome``, which adds ``lo`` back) all
start at 0, so ``DeviceUpdate`` and ``HostUpdate`` run unchanged over a part.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ...core.layout import Segment
from .param_home import ParamHome


@dataclass(frozen=True)
class Span:
    """Shard elements ``[lo, hi)`` of a group."""

    lo: int
    hi: int

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    def clip(self, segs: tuple[Segment, ...]) -> tuple[Segment, ...]:
        """The pieces of ``segs`` inside the span, their ``shard_start`` in span coordinates
        (``flat_start`` moved by the same amount as their start)."""
        out = []
        for s in segs:
            a, b = max(self.lo, s.shard_start), min(self.hi, s.shard_start + s.numel)
            if a < b:
                cut = a - s.shard_start
                out.append(
                    replace(s, flat_start=s.flat_start + cut, shard_start=a - self.lo, numel=b - a)
                )
        return tuple(out)


class PartHome:
    """The param home of a span: the group's home, addressed from ``span.lo``. ``prepare_write``
    and ``publish`` are the whole group's, called once per step by the twin update itself."""

    def __init__(self, home: ParamHome, span: Span) -> None:
        self.home, self.span = home, span
        self.where = home.where

    def read(self, lo: int, hi: int) -> torch.Tensor:
        return self.home.read(self.span.lo + lo, self.span.lo + hi)

    def write(self, lo: int, src: torch.Tensor, non_blocking: bool = False) -> None:
        self.home.write(self.span.lo + lo, src, non_blocking)

    def write_target(self, lo: int, hi: int) -> torch.Tensor | None:
        return self.home.write_target(self.span.lo + lo, self.span.lo + hi)

    def finish_write(self) -> None:
        self.home.finish_write()

    def host_shard(self) -> torch.Tensor | None:
        shard = self.home.host_shard()
        return None if shard is None else shard[self.span.lo : self.span.hi]

    def prepare_write(self) -> None:
        """The twin prepares the whole group's home before either part writes."""

    def flush(self) -> None:
        self.home.flush()

    def publish(self) -> None:
        """The twin publishes the whole group's home after both parts wrote."""
