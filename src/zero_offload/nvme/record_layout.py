"""The byte layout of one NVMe optimizer-state record (``optimizer_state.py``), by state format
(``core/state/format.py``): the one place the swap file's record arithmetic lives, shared by the
state itself, the swap files' room check and the memory model.

A record holds chunk k's three regions in the format's element types, in this order:

- ``master``: ``chunk`` fp32 or bf16 values;
- ``exp_avg`` and ``exp_avg_sq``: ``chunk`` fp32 or bf16 values, or (8-bit moments) ``chunk``
  uint8 codes followed by ``ceil(chunk / block)`` fp32 scales.

Invariants: every region starts at a multiple of ``ALIGN`` (4096 bytes) and is padded to whole
``ALIGN`` blocks, so each region is one direct I/O and the record is a whole number of blocks;
``chunk`` is a multiple of 2048 elements, so a block of 8-bit values never crosses a chunk
(blocks are at most 256 values) and the scales start 4-byte aligned after the codes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.state.format import StateFormat
from ..core.state.shard_state import KINDS
from .io.aio import ALIGN

CHUNK_ALIGN = ALIGN // 2  # elements: a chunk's bf16 region is whole blocks


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


@dataclass(frozen=True)
class RecordLayout:
    chunk: int  # elements per record
    fmt: StateFormat
    sizes: tuple[int, ...] = field(init=False)  # bytes each region uses (unpadded), by KINDS
    offsets: tuple[int, ...] = field(init=False)  # each region's start in the record, by KINDS
    spans: tuple[int, ...] = field(init=False)  # each region's padded size, by KINDS
    record: int = field(init=False)  # bytes of the record: the padded regions

    def __post_init__(self) -> None:
        if self.chunk <= 0 or self.chunk % CHUNK_ALIGN:
            raise ValueError(
                f"a record's chunk must be a multiple of {CHUNK_ALIGN}, got {self.chunk}"
            )
        fmt, n = self.fmt, self.chunk
        if fmt.moments == "8bit":
            moment = n + self.scales_of(n) * 4
        else:
            moment = n * (2 if fmt.moments == "bf16" else 4)
        sizes = (n * fmt.master_bytes, moment, moment)
        spans = tuple(_padded(s) for s in sizes)
        offsets = tuple(sum(spans[:i]) for i in range(len(KINDS)))
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "spans", spans)
        object.__setattr__(self, "offsets", offsets)
        object.__setattr__(self, "record", sum(spans))

    @property
    def quantized(self) -> bool:
        """The moments are 8-bit codes plus scales."""
        return self.fmt.moments == "8bit"

    def scales_of(self, n: int) -> int:
        """fp32 scales of a moment of ``n`` values (8-bit moments)."""
        return -(-n // self.fmt.block)

    def region(self, kind: str) -> tuple[int, int]:
        """(start in the record, padded size) of ``kind``'s region."""
        i = KINDS.index(kind)
        return self.offsets[i], self.spans[i]

    def kind_at(self, byte: int) -> str:
        """The region holding byte ``byte`` of the record."""
        for kind, start, span in zip(KINDS, self.offsets, self.spans):
            if start <= byte < start + span:
                return kind
        raise ValueError(f"byte {byte} is outside a record of {self.record} bytes")


def nvme_state_bytes(numel: int, chunk: int, fmt: StateFormat | None = None) -> int:
    """Swap bytes of one group's NVMe state of ``numel`` elements: two versions of a record per
    ``chunk`` elements, whole chunks (fp32 states: ``2 * chunks * chunk * 12``)."""
    layout = RecordLayout(chunk, fmt if fmt is not None else StateFormat())
    return 2 * max(1, -(-numel // chunk)) * layout.record
