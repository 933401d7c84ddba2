"""``DeepSpeedCPUAdam``: a ``torch.optim.Optimizer`` over CPU parameters that runs this project's
host Adam kernel (``zero_offload.kernels.host_adam``), with DeepSpeed's signature and semantics.

Semantics kept from DeepSpeed's ``deepspeed.ops.adam.DeepSpeedCPUAdam``:

- params live on the CPU, in fp32, bf16 or fp16; a param without ``.grad`` is skipped;
- the parameter itself is the weight being updated: a bf16/fp16 param keeps no fp32 master copy,
  each step computes in fp32 and writes the result back rounded to nearest even;
- ``adamw_mode`` picks decoupled weight decay (AdamW, the default) or L2 (Adam);
- state per param is ``step`` (int), ``exp_avg`` and ``exp_avg_sq``: fp32 by default, in the
  param's dtype with ``fp32_optimizer_states=False``;
- ``amsgrad`` is refused.

Gradients may be any float dtype (fp32/bf16/fp16 are read directly by the kernel, others are
converted). ``state_dict()``/``load_state_dict()`` round-trip exactly, fp32 states of 16-bit
params included (torch's loader would cast them to the param's dtype; this one does not).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ...kernels.host_adam import host_adam_step

_KERNEL_GRADS = (torch.float32, torch.bfloat16, torch.float16)
_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_number(name: str, value: Any, low: float, high: float | None = None) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= low
    if ok and high is not None:
        ok = value < high
    if not ok:
        bound = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"DeepSpeedCPUAdam: {name} must be a number {bound}, got {value!r}")


class DeepSpeedCPUAdam(torch.optim.Optimizer):
    def __init__(
        self,
        model_params: Iterable,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ) -> None:
        _check_number("lr", lr, 0.0)
        _check_number("eps", eps, 0.0)
        _check_number("weight_decay", weight_decay, 0.0)
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise ValueError(f"DeepSpeedCPUAdam: betas must be a pair, got {betas!r}")
        _check_number("betas[0]", betas[0], 0.0, 1.0)
        _check_number("betas[1]", betas[1], 0.0, 1.0)
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            amsgrad=amsgrad,
        )
        super().__init__(model_params, defaults)
        self.adam_w_mode = bool(adamw_mode)
        self.fp32_optimizer_states = bool(fp32_optimizer_states)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if param_group.get("amsgrad", self.defaults["amsgrad"]):
            raise RuntimeError("DeepSpeedCPUAdam does not support the AMSGrad variant.")
        super().add_param_group(param_group)
        for i, p in enumerate(self.param_groups[-1]["params"]):
            if p.device.type != "cpu":
                raise ValueError(
                    f"DeepSpeedCPUAdam: param_groups[{len(self.param_groups) - 1}].params[{i}] is "
                    f"on {p.device}; CPU Adam needs CPU params (enable offload_optimizer "
                    '{"device": "cpu"} in the ZeRO config to train GPU models with it)'
                )
            if p.dtype not in _PARAM_DTYPES:
                raise ValueError(
                    f"DeepSpeedCPUAdam: param_groups[{len(self.param_groups) - 1}].params[{i}] "
                    f"has dtype {p.dtype}; allowed: float32, bfloat16, float16"
                )

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)

    def _state_for(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if len(state) == 0:
            dtype = torch.float32 if self.fp32_optimizer_states else p.dtype
            state["step"] = 0
            state["exp_avg"] = torch.zeros(p.shape, dtype=dtype)
            state["exp_avg_sq"] = torch.zeros(p.shape, dtype=dtype)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        """One Adam(W) step for every param with a gradient. Returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.device.type != "cpu":
                    raise RuntimeError(
                        f"DeepSpeedCPUAdam: param is on {p.device}; it must be on the CPU"
                    )
                state = self._state_for(p)
                state["step"] += 1
                grad = p.grad
                if grad.dtype not in _KERNEL_GRADS:
                    grad = grad.to(torch.float32)
                grad = grad.contiguous()
                self._update(p, grad, state, group, beta1, beta2)
        return loss

    def _update(self, p, grad, state, group, beta1: float, beta2: float) -> None:
        # Invariant: the kernel reads and writes fp32 contiguous master/moments. Where the param
        # or the states are something else, fp32 temporaries stand in and are written back.
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        m = (
            exp_avg
            if exp_avg.dtype == torch.float32 and exp_avg.is_contiguous()
            else exp_avg.float().contiguous()
        )
        v = (
            exp_avg_sq
            if exp_avg_sq.dtype == torch.float32 and exp_avg_sq.is_contiguous()
            else exp_avg_sq.float().contiguous()
        )
        direct = p.dtype == torch.float32 and p.data.is_contiguous()
        master = p.data if direct else p.data.float().contiguous()
        out = None
        if not direct and p.dtype != torch.float32 and p.data.is_contiguous():
            out = p.data  # the kernel rounds the new weight into the 16-bit param itself
        host_adam_step(
            master.view(-1),
            m.view(-1),
            v.view(-1),
            grad.view(-1),
            None if out is None else out.view(-1),
            step=int(state["step"]),
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            adamw=self.adam_w_mode,
            bias_correction=bool(group["bias_correction"]),
        )
        if not direct and out is None:
            p.data.copy_(master.view_as(p.data))
        if m is not exp_avg:
            exp_avg.copy_(m.view_as(exp_avg))
        if v is not exp_avg_sq:
            exp_avg_sq.copy_(v.view_as(exp_avg_sq))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loader, except that the moments keep the dtype they were saved in (torch
        would cast fp32 moments of a bf16 param to bf16)."""
        saved = state_dict["state"]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        if len(ids) != len(params):
            raise ValueError(
                f"DeepSpeedCPUAdam.load_state_dict: the state dict has {len(ids)} params, "
                f"this optimizer {len(params)}"
            )
        super().load_state_dict(state_dict)
        for pid, p in zip(ids, params):
            entry = saved.get(pid)
            if not entry:
                continue
            for key in ("exp_avg", "exp_avg_sq"):
                value = entry.get(key)
                if isinstance(value, torch.Tensor):
                    self.state[p][key] = value.detach().to("cpu", copy=True).contiguous()
            self.state[p]["step"] = int(entry["step"])
