"""The host update's staging: where its 16-bit output waits for the trip to the param home,
one object chosen once when the update is built (``choose_staging``), never re-derived per call.

- ``Unstaged``: no 16-bit output. The master is the params' own dtype (fp32 training, or a bf16
  master under ``bf16_master_weights_and_grads``), so each chunk uploads from the master
  itself; an aliased master is the home (nothing travels at all).
- ``InPlace``: the home is a host param shard (stage 3 with offload_param "cpu"): the kernel
  writes its 16-bit output there directly; nothing travels.
- ``PerChunk``: the home is an NVMe swap file, which lends its write buffer per chunk (the
  kernel writes there directly), else one chunk of staging.
- ``Whole``: a 16-bit buffer of the whole shard (a device home, or the delayed update, whose
  worker must not write the home the next forward reads); uploaded chunk by chunk, chunk k
  travelling while chunk k+1 computes.

Invariant: ``out(lo, hi)`` is where the kernel writes shard range ``[lo, hi)``'s 16-bit values
(None: it writes none), and ``send(lo, hi, master)`` then makes the home hold them.
"""

from __future__ import annotations

import torch

from ....core.labels import PARAM_H2D, label
from ....core.pinned_bytes import host_bytes
from ....core.streams import Streams, alloc_host
from ..placement import Placement


class Staging:
    kind = "none"
    # The uploads read the state's own chunk buffers (an NVMe record's are reused by the
    # next read: such an upload must land before the next chunk is read).
    reads_master = True

    def __init__(self, home, streams: Streams, aliased: bool = False) -> None:
        self.home, self.streams, self.aliased = home, streams, aliased

    def out(self, lo: int, hi: int) -> torch.Tensor | None:
        return None

    def send(self, lo: int, hi: int, master: torch.Tensor) -> None:
        """Shard range ``[lo, hi)`` to the home, after the kernel wrote ``out(lo, hi)``."""
        if not self.aliased:  # an aliased master is the home itself
            self._upload(lo, master)

    def put(self, lo: int, hi: int, src: torch.Tensor) -> None:
        """The home takes ``src``'s values (an update that ran outside the kernel)."""
        out = self.out(lo, hi)
        if out is not None:  # cast to 16 bits (in place when the staging is the home)
            out.copy_(src)
        self.send(lo, hi, src)

    def _upload(self, lo: int, src: torch.Tensor) -> None:
        st = self.streams
        with label(PARAM_H2D), st.use(st.h2d):
            self.home.write(lo, src, non_blocking=st.cuda)

    def nbytes(self) -> dict[str, int]:
        return {}


class Unstaged(Staging):
    """No 16-bit copy: uploads read the master (the params' own dtype)."""


class InPlace(Staging):
    kind = "in place"
    reads_master = False

    def __init__(self, home, streams: Streams, shard: torch.Tensor) -> None:
        super().__init__(home, streams)
        self.shard = shard

    def out(self, lo: int, hi: int) -> torch.Tensor | None:
        return self.shard[lo:hi]

    def send(self, lo: int, hi: int, master: torch.Tensor) -> None:
        """The kernel wrote the home itself."""


class Whole(Staging):
    kind = "whole"
    reads_master = False

    def __init__(self, home, streams: Streams, numel: int, dtype: torch.dtype, pin: bool) -> None:
        super().__init__(home, streams)
        self.buffer = alloc_host(numel, dtype, pin)

    def out(self, lo: int, hi: int) -> torch.Tensor | None:
        return self.buffer[lo:hi]

    def send(self, lo: int, hi: int, master: torch.Tensor) -> None:
        self._upload(lo, self.buffer[lo:hi])

    def nbytes(self) -> dict[str, int]:
        return {"host.param_staging": host_bytes(self.buffer)}


class PerChunk(Whole):
    """An NVMe home: its write buffer when it lends one, else one chunk of staging."""

    kind = "per chunk"

    def __init__(self, home, streams: Streams, chunk: int, dtype: torch.dtype, pin: bool) -> None:
        super().__init__(home, streams, chunk, dtype, pin)
        self._lent = False

    def out(self, lo: int, hi: int) -> torch.Tensor | None:
        target = self.home.write_target(lo, hi)
        self._lent = target is not None
        return target if target is not None else self.buffer[: hi - lo]

    def send(self, lo: int, hi: int, master: torch.Tensor) -> None:
        if self._lent:  # the kernel wrote the swap file's buffer
            self._lent = False
            self.home.finish_write()
        else:
            self._upload(lo, self.buffer[: hi - lo])


def choose_staging(
    home,
    streams: Streams,
    numel: int,
    dtype: torch.dtype,
    place: Placement,
    master_dtype: torch.dtype,
    aliased: bool,
    delayed: bool,
) -> Staging:
    """The staging of a host update of ``numel`` elements whose params are ``dtype``."""
    if master_dtype == dtype or aliased:  # the master uploads itself (or is the home)
        return Unstaged(home, streams, aliased)
    if not delayed:  # the delayed update's worker must not write what the forward reads
        shard = home.host_shard()
        if shard is not None:
            return InPlace(home, streams, shard)
        if home.where == "nvme":
            return PerChunk(home, streams, place.chunk, dtype, place.pin)
    return Whole(home, streams, numel, dtype, place.pin)
