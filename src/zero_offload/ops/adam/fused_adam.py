"""``FusedAdam``: DeepSpeed's fused Adam(W) name and signature over torch's own Adam/AdamW.

torch's ``fused=True`` implementation is used where this torch has one for the params' device
(CUDA, and the CPU on recent torch), ``foreach`` otherwise. ``adam_w_mode`` picks decoupled
weight decay (the default) or L2; ``set_grad_none`` is DeepSpeed's ``zero_grad`` default.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class FusedAdam(torch.optim.AdamW):
    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        if not bias_correction:
            raise ValueError(
                "FusedAdam: bias_correction=False is not supported by torch's Adam; "
                "use zero_offload.ops.adam.DeepSpeedCPUAdam (CPU params) for it"
            )
        params = list(params)
        self.adam_w_mode = bool(adam_w_mode)
        self.set_grad_none = bool(set_grad_none)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        fused = self._fused_supported()
        for group in self.param_groups:
            group["decoupled_weight_decay"] = self.adam_w_mode
            group["fused"] = fused or None
            group["foreach"] = None if fused else True
            group["bias_correction"] = True

    def _fused_supported(self) -> bool:
        devices = {p.device.type for g in self.param_groups for p in g["params"]}
        dtypes = {p.dtype for g in self.param_groups for p in g["params"]}
        if not dtypes <= {torch.float32, torch.float16, torch.bfloat16, torch.float64}:
            return False
        try:
            from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

            return devices <= set(_get_fused_kernels_supported_devices())
        except ImportError:
            return devices == {"cuda"}

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)
