"""Bytes of the optimizer state per element, by state format (``core/state/format.py``): the
arithmetic the memory formula (``memory.expected_bytes``), the step model (``memory_model``),
``zero-offload estimate`` and the NVMe swap files' room check share.

Per element of a shard: the master (fp32 4, bf16 2) and both Adam moments (fp32 8, bf16 4,
8-bit 2 plus one fp32 scale per ``block`` values of each moment, ``ceil(n / block)`` per
moment of a record of n values). Today's fp32 state is 12 bytes per element; DeepSpeed's bf16
master with bf16 moments 6; a bf16 master with 8-bit moments 4 + 8 / block.
"""

from __future__ import annotations

import torch

from ...core.state.format import FP32, StateFormat
from ...nvme.record_layout import RecordLayout
from ...nvme.record_layout import nvme_state_bytes as _swap_bytes

# The modes ``zero-offload estimate`` compares (``mode_format``).
MODES = ("fp32", "bf16", "8bit")
MODE_NAMES = {"fp32": "fp32 states", "bf16": "bf16 states", "8bit": "8-bit moments"}


def master_bytes(numel: int, state: StateFormat = FP32) -> int:
    """The master of ``numel`` elements."""
    return numel * state.master_bytes


def moment_bytes(numel: int, state: StateFormat = FP32) -> int:
    """Both moments of ``numel`` elements, the 8-bit scales included (whole blocks)."""
    if state.moments == "8bit":
        return 2 * (numel + -(-numel // state.block) * 4)
    return numel * (8 if state.moments == "fp32" else 4)


def record_bytes(numel: int, state: StateFormat = FP32) -> int:
    """The values of ``numel`` elements' master and both moments (fp32: the three 4-byte
    tensors, 12 bytes per element); an NVMe record pads each region (``swap_record_bytes``)."""
    return master_bytes(numel, state) + moment_bytes(numel, state)


def swap_record_bytes(chunk: int, state: StateFormat = FP32) -> int:
    """One NVMe swap record as the file and the buffer pool hold it: ``record_bytes(chunk)``
    with each region padded to whole 4096-byte blocks (``nvme/record_layout.py``)."""
    return RecordLayout(chunk, state).record


def nvme_state_bytes(numel: int, chunk: int, state: StateFormat = FP32) -> int:
    """Swap bytes of one group's NVMe state: two versions of a padded record per ``chunk``
    elements, whole chunks (``nvme/record_layout.py``); fp32: ``2 * chunks * chunk * 12``."""
    return _swap_bytes(numel, chunk, state)


def mode_format(mode: str, dtype: torch.dtype, block: int = 256) -> StateFormat:
    """The state format of an estimate mode for training in ``dtype``: ``fp32`` (today's),
    ``bf16`` (DeepSpeed's bf16 master + bf16 moments: bf16 training only) or ``8bit`` (8-bit
    moments beside a bf16 master in bf16 training, an fp32 master otherwise)."""
    if mode == "fp32":
        return FP32
    bf16 = dtype == torch.bfloat16
    if mode == "bf16":
        if not bf16:
            raise ValueError(
                "bf16 states (bf16.bf16_master_weights_and_grads) need bf16 training: "
                f"--dtype bf16 (got {str(dtype).removeprefix('torch.')})"
            )
        return StateFormat(master=torch.bfloat16, moments="bf16")
    if mode == "8bit":
        master = torch.bfloat16 if bf16 else torch.float32
        return StateFormat(master=master, moments="8bit", block=block)
    raise ValueError(f"state mode must be one of {', '.join(MODES)}, got {mode!r}")


def modes_for(dtype: torch.dtype) -> tuple[str, ...]:
    """The modes that exist for training in ``dtype`` (bf16 states only with bf16)."""
    return MODES if dtype == torch.bfloat16 else ("fp32", "8bit")


def state_name(state: StateFormat) -> str:
    """A format's short name in tables (``StateFormat.name``)."""
    return state.name
