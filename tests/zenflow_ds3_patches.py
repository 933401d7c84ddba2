"""What DeepSpeed 0.19.8's stage-3 ZenFlow needs to run on the CPU (gloo) for the comparison runs
of ``zenflow_run.py``, and nothing that changes what it trains (docs/zenflow.md, "Stage 3").

Imported only by a DeepSpeed run (``--impl deepspeed``); each patch must be in place before
``deepspeed.initialize``: the optimizer binds ``engine_stage3``'s hooks when it is built
(``create_zenflow_hooks``, ``functools.partial`` over the module's functions).
"""

from __future__ import annotations

import types

import torch


class _TorchOnDevice:
    """``torch`` as seen by one copied DeepSpeed function: ``torch.zeros`` and ``torch.tensor``
    with ``device='cuda'`` allocate on ``device`` instead; everything else is torch's."""

    def __init__(self, device: str) -> None:
        self._device = device

    def __getattr__(self, name: str):
        return getattr(torch, name)

    def _on(self, device):
        return self._device if device is not None and str(device) == "cuda" else device

    def zeros(self, *size, device=None, **kw) -> torch.Tensor:
        return torch.zeros(*size, device=self._on(device), **kw)

    def tensor(self, data, *, device=None, **kw) -> torch.Tensor:
        return torch.tensor(data, device=self._on(device), **kw)


def _with_device(fn, device: str):
    """A copy of module function ``fn`` (same code, same globals) whose ``torch`` allocates its
    ``device='cuda'`` buffers on ``device``."""
    scope = dict(fn.__globals__, torch=_TorchOnDevice(device))
    copy = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__, copy.__doc__ = fn.__kwdefaults__, fn.__doc__
    return copy


def fix_stage3_devices() -> None:
    """DeepSpeed 0.19.8's stage-3 ZenFlow allocates with ``device='cuda'`` whatever the engine's
    accelerator: in ``engine_stage3.update_selected_channels`` the per-column sums
    (``grad_sum_buffer``) and each param's ``selected_indices``, in
    ``_process_selected_fp32_groups_grad`` the "auto" rule's ``sum_buffer`` and
    ``critic_sum_buffer``. On a CPU build of torch the first selection fails ("Torch not compiled
    with CUDA enabled"). This replaces those two functions by copies of themselves whose
    ``torch.zeros``/``torch.tensor`` put a ``'cuda'`` buffer on the accelerator's device (``'cpu'``
    here; on a GPU the current CUDA device, as before): the same values in the same dtype, every
    other line of DeepSpeed unchanged."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zenflow import engine_stage3 as zf3

    device = get_accelerator().current_device_name()
    for name in ("update_selected_channels", "_process_selected_fp32_groups_grad"):
        setattr(zf3, name, _with_device(getattr(zf3, name), device))


class _FinishEachUpdate:
    """DeepSpeed's native ZenFlow op with ``zenflow_adam_submit`` waiting for the update it
    submits; each later ``zenflow_adam_wait`` takes one of those completions (returns at once),
    so DeepSpeed's own waits stay where they are and the semaphore stays balanced."""

    def __init__(self, op, poll_seconds: float) -> None:
        self._op, self._poll, self._finished = op, poll_seconds, 0

    def __getattr__(self, name: str):
        return getattr(self._op, name)

    def zenflow_adam_submit(self, ctrl, *args) -> None:
        self._op.zenflow_adam_submit(ctrl, *args)
        while not self._op.zenflow_adam_wait(ctrl, self._poll):
            pass
        self._finished += 1

    def zenflow_adam_wait(self, ctrl, timeout) -> bool:
        if self._finished > 0:
            self._finished -= 1
            return True
        return self._op.zenflow_adam_wait(ctrl, timeout)


def finish_overlapped_updates_stage3() -> None:
    """Stage 3's ``overlap_step`` (``engine_stage3.step``): the optimizer process started by
    ``start_optimizer_process`` updates the fp32 partition and its stale copy while the next
    steps run, and the wait after the first update past the warm-up is skipped, so a later wait
    can take an earlier update's completion while the latest still runs: which master a
    selection's copy or a ``wait_last_update_and_copy`` reads depends on timing. As
    ``finish_overlapped_updates`` at stages 1/2, this makes every submitted update finish before
    ``zenflow_adam_submit`` returns (the order a fast optimizer process gives), keeping
    DeepSpeed's waits and copies as they are. ``engine_stage3``'s overlap lambdas look its
    functions up when called, so replacing ``start_optimizer_process`` there wraps the op the
    process was started with."""
    from deepspeed.runtime.zenflow import engine_stage3 as zf3

    start = zf3.start_optimizer_process
    poll = zf3.ZENFLOW_OPTIMIZER_WAIT_POLL_SECONDS

    def start_and_finish_in_order(optimizer_z3) -> None:
        start(optimizer_z3)
        optimizer_z3.zf_op = _FinishEachUpdate(optimizer_z3.zf_op, poll)

    zf3.start_optimizer_process = start_and_finish_in_order


def fix_auto_update_stage3() -> None:
    """``update_interval`` "auto" at stage 3 has the flip-order bug ``fix_auto_update`` fixes at
    stages 1/2: the engine flips ``zenflow_state`` after the optimizer's backward prologue
    (``engine_stage3.zenflow_backward_prologue``) has cleared the slot the last backward set, so
    the rule never ends an interval. This flips the state before that prologue and back after it
    (the engine then flips it as before); the rule is DeepSpeed's, unchanged. The loss divided by
    ``gradient_accumulation_steps`` 0 is the engine's, fixed for every stage by
    ``fix_auto_update``."""
    from deepspeed.runtime.zenflow import engine_stage3 as zf3

    prologue = zf3.zenflow_backward_prologue

    def prologue_after_flip(optimizer_z3) -> None:
        if optimizer_z3.auto_update:  # the engine's flip, made first; undone for it to redo
            optimizer_z3.zenflow_state ^= 1
        prologue(optimizer_z3)
        if optimizer_z3.auto_update:
            optimizer_z3.zenflow_state ^= 1

    zf3.zenflow_backward_prologue = prologue_after_flip


def fix_stage3_moment_shapes() -> None:
    """On several ranks DeepSpeed 0.19.8's stage-3 selection is global (top-k over every rank's
    candidate columns of a param), so the number of a param's selected columns in one rank's
    partition changes from one selection to the next; but its ``ZenFlowSelectiveAdamW_stage3``
    allocates a param's device moments once, at the first selection's count, and each later
    selection only zeroes them (``clear_selected_mv``). At the first selection whose count
    differs its next device step fails (``param.addcdiv_``: "output with shape [1, 16] doesn't
    match the broadcast shape [2, 16]"), on any device. This re-allocates the moments of such a
    param at the new count right after the selection (``update_selected_channels``), as zeros:
    the selection's prologue has just zeroed them and nothing has read them since (asserted),
    so every value DeepSpeed computes is unchanged; its step count goes on, as DeepSpeed's."""
    import sys

    from deepspeed.runtime.zenflow import engine_stage3 as zf3

    select = zf3.update_selected_channels

    def select_and_resize(optimizer_z3, params_to_update, grad_partitions) -> None:
        select(optimizer_z3, params_to_update, grad_partitions)
        state = optimizer_z3.selective_optimizer.state
        for p in params_to_update:
            s = state.get(p) or {}
            if "exp_avg" not in s or not hasattr(p, "selected_indices"):
                continue
            k = p.selected_indices.numel()
            if s["exp_avg"].shape[0] == k:
                continue
            for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                if key in s:
                    assert not s[key].any(), "moments not zeroed by the selection"
                    s[key] = s[key].new_zeros((k, *s[key].shape[1:]))
            print(
                f"zenflow_ds3_patches: micro-step {optimizer_z3.micro_step}, param "
                f"{p.ds_id} {tuple(p.ds_shape)}: device moments re-sized to {k} columns",
                file=sys.stderr,
            )

    zf3.update_selected_channels = select_and_resize
