"""``deepspeed.utils.tensor_fragment``: ``fragment_address`` (a DeepSpeed checkpoint pickles it
in its ``*_optim_states.pt``) and the tensor-fragment API under this module's names."""

from __future__ import annotations

from dataclasses import dataclass

from ...utils import (  # noqa: F401
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
)
from .._common import not_provided_getattr


@dataclass
class fragment_address:  # noqa: N801 (DeepSpeed's name)
    """Where a param's fragment starts in a flat partition, and its length (DeepSpeed's)."""

    numel: int
    start: int


__getattr__ = not_provided_getattr(__name__)
