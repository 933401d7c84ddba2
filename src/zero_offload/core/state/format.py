"""How a group's optimizer state stores each element: the state format, one typed policy.

Three choices, read once from the config (``StateFormat.from_config``):

- ``master``: fp32 (the default) or bf16 (DeepSpeed's ``bf16.bf16_master_weights_and_grads``:
  the master is the 16-bit param's own dtype, so where both live in the same memory they are
  one tensor);
- ``moments``: fp32, bf16 (``bf16.bf16_optimizer_states``) or 8-bit (optimizer ``Adam8bit`` /
  ``AdamW8bit``: uint8 codes plus one fp32 absmax per ``block`` elements, ``kernels/quant_maps``);
- ``stochastic_round``: a bf16 master written with stochastic rounding (``bf16.
  stochastic_rounding``) instead of round-to-nearest-even, seeded by ``seed``.

Invariant: ``StateFormat()`` is today's fp32 state, and every path that does not know a format
receives that one; a format the path cannot run is refused where it is built, by key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

Moments = Literal["fp32", "bf16", "8bit"]
MOMENT_BYTES: dict[str, float] = {"fp32": 4.0, "bf16": 2.0, "8bit": 1.0}
DEFAULT_BLOCK = 256


@dataclass(frozen=True)
class StateFormat:
    master: torch.dtype = torch.float32  # float32 or bfloat16
    moments: Moments = "fp32"
    block: int = DEFAULT_BLOCK  # 8-bit moments: elements per fp32 scale
    stochastic_round: bool = False  # bf16 master only
    seed: int = 0  # the stochastic rounding's seed

    def __post_init__(self) -> None:
        if self.master not in (torch.float32, torch.bfloat16):
            raise ValueError(f"StateFormat.master must be float32 or bfloat16, got {self.master}")
        if self.moments not in MOMENT_BYTES:
            raise ValueError(f"StateFormat.moments must be one of {sorted(MOMENT_BYTES)}")
        if self.stochastic_round and self.master != torch.bfloat16:
            raise ValueError("stochastic rounding applies to a bf16 master only")

    @property
    def compact(self) -> bool:
        """Anything but today's fp32 master and fp32 moments."""
        return self.master != torch.float32 or self.moments != "fp32"

    @property
    def master_bytes(self) -> int:
        return 2 if self.master == torch.bfloat16 else 4

    def moment_bytes(self) -> float:
        """Bytes per element of both moments together, the 8-bit scales included."""
        per = MOMENT_BYTES[self.moments]
        scales = 4.0 / self.block if self.moments == "8bit" else 0.0
        return 2 * (per + scales)

    @property
    def name(self) -> str:
        """The format's short name: fp32, bf16 (DeepSpeed's bf16 master + moments), 8bit
        (8-bit moments; ``+bf16`` with a bf16 master), bf16-master (fp32 moments)."""
        bf16_master = self.master == torch.bfloat16
        if self.moments == "8bit":
            return "8bit+bf16" if bf16_master else "8bit"
        if self.moments == "bf16":
            return "bf16"
        return "bf16-master" if bf16_master else "fp32"

    def same_storage(self, other: StateFormat) -> bool:
        """Both keep every element in the same types (rounding and seed aside)."""
        mine = (self.master, self.moments, self.block if self.moments == "8bit" else 0)
        theirs = (other.master, other.moments, other.block if other.moments == "8bit" else 0)
        return mine == theirs

    def bytes_per_element(self) -> float:
        """Master plus both moments, per shard element."""
        return self.master_bytes + self.moment_bytes()

    @classmethod
    def from_config(cls, config: Any) -> StateFormat:
        """The format a validated ``ZeroOffloadConfig`` asks for (its ``bf16`` block and
        optimizer type; the config's rules already refused what does not combine). A config
        without an optimizer block (a client optimizer, or none) and without the bf16 keys:
        fp32 states."""
        bf, opt = config.bf16, config.optimizer
        eight_bit = opt is not None and opt.eight_bit
        moments: Moments = "fp32"
        if eight_bit:
            moments = "8bit"
        elif bf.bf16_optimizer_states:
            moments = "bf16"
        return cls(
            master=torch.bfloat16 if bf.bf16_master_weights_and_grads else torch.float32,
            moments=moments,
            block=int(opt.params.block_size) if eight_bit else DEFAULT_BLOCK,
            stochastic_round=bool(bf.stochastic_rounding),
            seed=int(config.seed or 0),
        )


FP32 = StateFormat()


_MOMENT_CODES: list[Moments] = ["fp32", "bf16", "8bit"]


def format_tensor(fmt: StateFormat, where: tuple[int, int, int]) -> torch.Tensor:
    """A checkpoint's record of the format a shard was saved in, and ``where`` (world size,
    rank, shard numel): int64 [master is bf16, moments code, block, world, rank, numel]."""
    head = [int(fmt.master == torch.bfloat16), _MOMENT_CODES.index(fmt.moments), fmt.block]
    return torch.tensor(head + list(where), dtype=torch.int64)


def format_of(t: torch.Tensor) -> tuple[StateFormat, tuple[int, int, int]]:
    """``format_tensor`` read back (a damaged record raises ``ValueError``)."""
    v = [int(x) for x in t.reshape(-1).tolist()]
    if len(v) != 6 or v[0] not in (0, 1) or not 0 <= v[1] < len(_MOMENT_CODES):
        raise ValueError(f"state_format: not a saved state format ({v})")
    master = torch.bfloat16 if v[0] else torch.float32
    return StateFormat(master, _MOMENT_CODES[v[1]], v[2]), (v[3], v[4], v[5])
