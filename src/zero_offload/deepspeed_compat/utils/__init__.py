"""``deepspeed.utils``: the logger (zero_offload's: setting its level, as transformers does from
``TrainingArguments``, sets zero_offload's), ``log_dist``, ``set_log_level_from_string``
(:mod:`.logging`), the tensor-fragment API, the ZeRO-3
leaf-module names, ``RepeatingLoader``, ``groups`` (the data-parallel queries) and
``zero_to_fp32``."""

from __future__ import annotations

from ...data.dataloader import RepeatingLoader  # noqa: F401
from ...utils import (  # noqa: F401
    get_z3_leaf_modules,
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
    set_z3_leaf_module,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)
from .._common import not_provided_getattr
from ..comm import is_initialized  # noqa: F401
from . import groups, logging, tensor_fragment, zero_to_fp32  # noqa: F401
from .logging import log_dist, logger, set_log_level_from_string  # noqa: F401

__getattr__ = not_provided_getattr(__name__)
