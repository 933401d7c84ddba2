"""``deepspeed.runtime.zero.partition_parameters``: ``zero.Init`` and ``GatheredParameters``
(zero_offload's), ``ZeroParamStatus``, and the module attributes transformers swaps around
``from_pretrained`` (``zero_wrapper_for_fp_tensor_constructor``, ``_orig_torch_arange``).

zero_offload's ``Init`` does not wrap torch's tensor constructors (params take the config's
dtype when they are partitioned; buffers keep theirs), so swapping the wrapper changes nothing;
it is here, with DeepSpeed's behaviour, for the code that does."""

from __future__ import annotations

import functools

import torch

from ....core.status import ZeroParamStatus
from ....zero import GatheredParameters, register_external_parameter
from ....zero import Init as _Init
from ..._common import as_zero_offload_config, not_provided_getattr
from ...accelerator import get_accelerator
from ...comm import init_distributed

_orig_torch_arange = torch.arange
_orig_torch_empty = torch.empty
_orig_torch_zeros = torch.zeros
_orig_torch_ones = torch.ones
_orig_torch_full = torch.full

__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "get_accelerator",
    "register_external_parameter",
    "zero_wrapper_for_fp_tensor_constructor",
]
__getattr__ = not_provided_getattr(__name__)


class Init(_Init):
    """``deepspeed.zero.Init``: zero_offload's, after DeepSpeed's process-group set-up (a group
    of one without a launcher, see ``deepspeed.comm.init_distributed``), reading the config as
    ``deepspeed.initialize`` does."""

    def __init__(
        self,
        module=None,
        data_parallel_group=None,
        mem_efficient_linear: bool = True,
        remote_device=None,
        pin_memory: bool = False,
        config_dict_or_path=None,
        config=None,
        enabled: bool = True,
        dtype=None,
        mpu=None,
        **kwargs,
    ) -> None:
        if enabled:
            init_distributed()
        super().__init__(
            module=module,
            data_parallel_group=data_parallel_group,
            mem_efficient_linear=mem_efficient_linear,
            remote_device=remote_device,
            pin_memory=pin_memory,
            config_dict_or_path=as_zero_offload_config(config_dict_or_path),
            config=as_zero_offload_config(config),
            enabled=enabled,
            dtype=dtype,
            mpu=mpu,
            **kwargs,
        )


def zero_wrapper_for_fp_tensor_constructor(fn, target_fp_dtype, target_device=None):
    """DeepSpeed's constructor wrapper: ``fn``'s tensor made on ``target_device`` and, when
    floating point, cast to ``target_fp_dtype``. Not used by zero_offload's ``Init``."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        tensor = fn(*args, **kwargs)
        return tensor.to(target_fp_dtype) if tensor.is_floating_point() else tensor

    return wrapped
