"""The device part of a ZenFlow step: AdamW over the selected columns of each param, in the
params' own dtype (fp16: in fp32), with torch's single-tensor AdamW arithmetic (DeepSpeed's selective AdamW).

State per param: ``exp_avg`` and ``exp_avg_sq`` of the selected columns' shape (zeroed when the
columns are chosen again) and a step count that is never reset (DeepSpeed's: bias correction
counts every device update since the first).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ColumnState:
    """One param's selected columns (None: a 1-D param, updated whole) and their moments."""

    columns: torch.Tensor | None
    exp_avg: torch.Tensor | None = None
    exp_avg_sq: torch.Tensor | None = None
    step: int = 0

    def reselected(self, columns: torch.Tensor | None) -> ColumnState:
        """The state for new ``columns``: the moments start from zero, the step count goes
        on."""
        return ColumnState(columns, step=self.step)


def read(param: torch.Tensor, state: ColumnState) -> torch.Tensor:
    """A copy of the selected part of ``param``."""
    data = param.detach()
    return data[:, state.columns].clone() if state.columns is not None else data.clone()


def write(param: torch.Tensor, state: ColumnState, value: torch.Tensor) -> None:
    data = param.detach()
    if state.columns is not None:
        data[:, state.columns] = value
    else:
        data.copy_(value)


@torch.no_grad()
def adamw_step(
    values: torch.Tensor, grad: torch.Tensor, state: ColumnState, hyper: dict
) -> tuple[torch.Tensor, ColumnState]:
    """``adamw_values`` without touching ``state``: the new values and the state after the
    step (its moments new tensors), so that a step can be staged and then kept or dropped."""
    after = ColumnState(state.columns, step=state.step)
    if state.exp_avg is not None:
        after.exp_avg, after.exp_avg_sq = state.exp_avg.clone(), state.exp_avg_sq.clone()
    return adamw_values(values, grad, after, hyper), after


@torch.no_grad()
def adamw_values(
    values: torch.Tensor, grad: torch.Tensor, state: ColumnState, hyper: dict
) -> torch.Tensor:
    """One AdamW step of the device part's ``values`` (any shape, the params' dtype) with
    ``grad`` (their shape); returns the new values in that dtype. Decoupled weight decay
    whatever the host optimizer's mode, as DeepSpeed's selective AdamW."""
    # fp16: fp32 arithmetic and moments (in fp16, eps 1e-8 is 0 and a small squared gradient
    # is 0: the update divides by zero); other dtypes: the params' own, as DeepSpeed.
    dtype = values.dtype
    work = torch.float32 if dtype == torch.float16 else dtype
    sel = values.to(work, copy=True)  # the caller keeps ``values`` (a rollback writes them back)
    grad = grad.to(work)
    if state.exp_avg is None or state.exp_avg.shape != sel.shape:
        state.exp_avg = torch.zeros_like(sel)
        state.exp_avg_sq = torch.zeros_like(sel)
    lr, wd, eps = float(hyper["lr"]), float(hyper["weight_decay"]), float(hyper["eps"])
    beta1, beta2 = (float(b) for b in hyper["betas"])
    state.step += 1
    sel.mul_(1 - lr * wd)
    state.exp_avg.lerp_(grad, 1 - beta1)
    state.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step = float(state.step)
    step_size = lr / (1 - beta1**step)
    denom = (state.exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
    sel.addcdiv_(state.exp_avg, denom, value=-step_size)
    return sel.to(dtype)
