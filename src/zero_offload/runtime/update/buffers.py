"""A group's device buffers, each named by the DeepSpeed offloadable state it belongs to: what
``offload_states`` moves and what its memory-report entry counts (``OptimizerGroup.buffers``).

A buffer in host memory or on NVMe is not listed: offloading a state that is already there is a
no-op, as DeepSpeed's exclusions under ``offload_optimizer`` make it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch


class OffloadStateType(str, Enum):
    """DeepSpeed's ``OffloadStateTypeEnum``."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


@dataclass(frozen=True)
class StateBuffer:
    tensor: torch.Tensor
    category: str | None  # the memory-report entry it is counted under (None: not counted)
    keep: bool = True  # False: scratch, reloaded with undefined contents
    also: frozenset = frozenset()  # other states that live in the same storage
    state: OffloadStateType | None = None  # the state it belongs to (a group's buffers say)
