"""DeepSpeed's ``deepspeed.utils`` names: the tensor-fragment API (``safe_get_full_*``,
``safe_set_full_*``, ``safe_get_local_*``, ``safe_set_local_*``,
``safe_update_full_grad_vectorized``: one parameter's fp32 master weight, optimizer state or
gradient, whole or this rank's piece; see ``tensor_fragment``), ``zero_to_fp32``, the ZeRO-3
leaf-module names and ``RepeatingLoader``.

Collective: every rank calls the tensor-fragment functions for the same params, in the same
order. Gradients are the averaged, unscaled, unclipped gradient of the current accumulation
window: use them after the boundary ``backward`` and before ``step``.
"""

from __future__ import annotations

from ..checkpoint.export.consolidate import get_fp32_state_dict_from_zero_checkpoint  # noqa: F401 (DeepSpeed's name)
from ..data.dataloader import RepeatingLoader  # noqa: F401 (deepspeed.utils)
from . import zero_to_fp32  # noqa: F401 (DeepSpeed: deepspeed.utils.zero_to_fp32)
from .tensor_fragment import (  # noqa: F401
    Zero3OnlyError,
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
    safe_update_full_grad_vectorized,
)
from .z3_leaf_module import (  # noqa: F401 (DeepSpeed: deepspeed.utils's leaf-module names)
    get_z3_leaf_modules,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)
