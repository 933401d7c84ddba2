"""The compact-state rows of the host update benchmark (zero_offload.kernels.bench): one step of
:func:`zero_offload.kernels.adam_step_states` per state kind, bf16 grad in, and DeepSpeed's CPU
Adam with its bf16 states (``bf16_master_weights_and_grads`` + ``bf16_optimizer_states``: bf16
param = master, bf16 grad, bf16 moments) when DeepSpeed is importable.

Each path has its own buffers (the fp32-state rows share theirs); ``BYTES`` is the memory
traffic of one step per parameter, which sets each row's bandwidth bound.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Path = tuple[str, Callable[[], Any]]

# Memory traffic per parameter and step: read + write of each state, read of the grad.
BYTES = {
    "states_bf16": 2 + 2 * (2 + 2 + 2),  # bf16 grad; bf16 master, exp_avg, exp_avg_sq
    "states_bf16_sr": 2 + 2 * (2 + 2 + 2),
    "states_q8": 2 + 2 * (2 + 1 + 1) + 2 * 2 * 4 / 256,  # + the fp32 scales per 256
    "states_q8_fp32": 2 + 2 * (4 + 1 + 1) + 2 + 2 * 2 * 4 / 256,  # + bf16 param_out
    "deepspeed_bf16": 2 + 2 * (2 + 2 + 2),
}
LABELS = {
    "states_bf16": "states: bf16 master+moments (8 B/param)",
    "states_bf16_sr": "states: bf16, stochastic rounding",
    "states_q8": "states: bf16 master, 8-bit moments (6 B)",
    "states_q8_fp32": "states: fp32 master, 8-bit moments (10 B)",
    "deepspeed_bf16": "DeepSpeedCPUAdam, bf16 params+moments",
}


def state_paths(n: int, threads: int, hp: dict, grad_scale: float, ds_cls) -> list[Path]:
    """The compact-state update paths over fresh buffers of n params."""
    import torch

    from zero_offload.kernels.adam_states import StateOptions, adam_step_states, zeros_moment

    def bf16_master() -> torch.Tensor:
        return torch.randn(n).mul_(0.02).to(torch.bfloat16)

    grad = torch.randn(n).to(torch.bfloat16)
    paths: list[Path] = []

    def path(name: str, master, exp_avg, exp_avg_sq, out=None, options=None) -> None:
        steps = [0]

        def run() -> None:
            steps[0] += 1
            adam_step_states(
                master, exp_avg, exp_avg_sq, grad, out, step=steps[0], adamw=True,
                grad_scale=grad_scale, threads=threads, options=options, **hp,
            )  # fmt: skip

        paths.append((name, run))

    def bf16_zeros() -> torch.Tensor:
        return torch.zeros(n, dtype=torch.bfloat16)

    path("states_bf16", bf16_master(), bf16_zeros(), bf16_zeros())
    path("states_bf16_sr", bf16_master(), bf16_zeros(), bf16_zeros(), options=StateOptions(1))
    path("states_q8", bf16_master(), zeros_moment(n, True), zeros_moment(n, False))
    path(
        "states_q8_fp32",
        torch.randn(n).mul_(0.02),
        zeros_moment(n, True),
        zeros_moment(n, False),
        out=torch.empty(n, dtype=torch.bfloat16),
    )
    if ds_cls is not None:
        paths.append(("deepspeed_bf16", _deepspeed_bf16(ds_cls, bf16_master(), grad, hp)))
    return paths


def _deepspeed_bf16(ds_cls, master, grad, hp: dict) -> Callable[[], Any]:
    """DeepSpeedCPUAdam over a bf16 param (the master itself), bf16 grad and bf16 moments, as
    DeepSpeed 0.19.8 runs ``bf16_optimizer_states`` with offload; nothing to copy back."""
    import torch

    param = torch.nn.Parameter(master, requires_grad=True)
    param.grad = grad
    common = dict(lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"])
    opt = ds_cls(
        [param], **common, weight_decay=hp["weight_decay"], adamw_mode=True,
        fp32_optimizer_states=False,
    )  # fmt: skip
    opt.state[param] = {
        "step": 0,
        "exp_avg": torch.zeros_like(master),
        "exp_avg_sq": torch.zeros_like(master),
    }
    return opt.step
