"""A partial offload's shard state: the device part ``[0, cut)`` and the host part
``[cut, numel)`` of one group's master shard and Adam moments, each a state in memory of its own
(``MemoryState``, or ``CompactState`` in a compact format), answering ``ShardState``'s questions
in the whole shard's coordinates.

So checkpoints, the tensor-fragment accessors and ``GatheredParameters`` write-backs see one
state of ``numel`` elements wherever its parts live: a checkpoint written by a twin is the same
file as one written by a device or host state, and loads into either (and back).

Invariant: ``update``'s chunks never cross the cut (the twin update's chunks are each part's);
``read`` of a range across it returns a host copy, ``write`` splits its source. The cut is a
multiple of ``CHUNK_ALIGN``, so of every 8-bit block: ``raw`` is the parts' codes and scales
joined, the same tensors a state of the whole shard saves.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .shard_state import Body, Chunk, Fill, InMemory, ShardState


class TwinState(InMemory):
    where = "host"  # the prefix of a client optimizer's report (never one here: Adam(W) only)
    aliased = False

    def close(self) -> None:
        """Memory: freed with the object."""

    def fill(self, master_of: Fill) -> None:
        def shifted(off: int) -> Fill:
            return lambda lo, hi, out: master_of(lo + off, hi + off, out)

        self.device.fill(shifted(0))
        self.host.fill(shifted(self.cut))

    def __init__(self, device: ShardState, host: ShardState) -> None:
        """Two parts of one format (``master_dtype`` theirs)."""
        assert device.master_dtype == host.master_dtype, "the parts share one format"
        self.device, self.host = device, host
        self.cut = device.numel
        self.numel = device.numel + host.numel
        self.master_dtype = host.master_dtype

    def parts(self) -> list[ShardState]:
        """The device part, then the host part (each a whole state of its own)."""
        return [self.device, self.host]

    def _parts(self, lo: int, hi: int):
        """(part, offset of the part, lo, hi) of each part that ``[lo, hi)`` reaches, in part
        coordinates."""
        for part, off in ((self.device, 0), (self.host, self.cut)):
            a, b = max(lo, off), min(hi, off + part.numel)
            if a < b:
                yield part, off, a - off, b - off

    def update(
        self,
        chunks: list[Chunk],
        body: Body,
        write: bool = True,
        before_commit: Callable[[], None] | None = None,
        commit: bool = True,
    ) -> None:
        for lo, hi in chunks:
            (part, off, a, b), *rest = self._parts(lo, hi)
            assert not rest, f"chunk [{lo}, {hi}) crosses the cut at {self.cut}"
            part.update([(a, b)], lambda x, y, v, o=off: body(x + o, y + o, v))
        if before_commit is not None:
            before_commit()

    def read(self, kind: str, lo: int, hi: int) -> torch.Tensor:
        pieces = [part.read(kind, a, b) for part, _, a, b in self._parts(lo, hi)]
        if len(pieces) == 1:
            return pieces[0]  # a view, in its part's memory
        if not pieces:
            return self.host.read(kind, 0, 0)
        return torch.cat([p.cpu() for p in pieces])

    def write(self, kind: str, lo: int, src: torch.Tensor) -> None:
        src = src.reshape(-1)
        for part, off, a, b in self._parts(lo, lo + src.numel()):
            part.write(kind, a, src[a + off - lo : b + off - lo])

    def raw(self) -> dict[str, torch.Tensor]:
        dev, host = self.device.raw(), self.host.raw()
        return {k: torch.cat([dev[k].cpu(), host[k].cpu()]) for k in host}

    def load_raw(self, fetch: Callable[[str], torch.Tensor | None]) -> None:
        """The saved whole-shard tensors split at the cut (codes at ``cut``, scales at its
        block); a size that does not fit is the parts' error."""
        sizes = {k: t.numel() for k, t in self.device.raw().items()}

        def piece(first: bool) -> Callable[[str], torch.Tensor | None]:
            def get(name: str) -> torch.Tensor | None:
                saved = fetch(name)
                if saved is None:
                    return None
                return saved[: sizes[name]] if first else saved[sizes[name] :]

            return get

        self.device.load_raw(piece(True))
        self.host.load_raw(piece(False))

    def nbytes(self) -> dict[str, int]:
        out = dict(self.device.nbytes())
        for k, v in self.host.nbytes().items():
            out[k] = out.get(k, 0) + v
        return out
