"""``checkpoint(function, *args)``: DeepSpeed's reentrant activation checkpoint. The forward
runs without a graph and keeps only the arguments (``stash.Stash``: on the device, or in host
memory with ``cpu_checkpointing``) and the random states (``rng.RngSnapshot``, the tracker's
included); the backward replays the states, recomputes the forward with a graph and runs its
backward as a nested graph task (the engine ends its backward on the outermost task)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .boundary import boundary
from .rng import RngSnapshot
from .settings import SETTINGS
from .stash import Stash

# Whether the caller of ``checkpoint`` records a graph (inside ``forward`` autograd has turned
# it off): only a forward whose backward can run keeps anything, since an eval forward under
# no_grad never reaches the backward that frees it. Set by ``checkpoint``, as DeepSpeed does.
_grad_enabled = [True]


class CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run_function: Callable, all_outputs: list, *args: Any):
        policy = SETTINGS.policy
        with boundary(policy, "forward"):
            ctx.run_function = run_function
            ctx.policy = policy
            ctx.stash = Stash(args, policy.cpu_checkpointing) if _grad_enabled[0] else None
            ctx.rng = RngSnapshot.take()
            with torch.no_grad():
                outputs = run_function(*args)
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
            all_outputs.append(outputs[0])
        else:
            all_outputs.extend(outputs)
        tensors = tuple(o for o in outputs if isinstance(o, torch.Tensor))
        ctx.mark_non_differentiable(*(t for t in tensors if not t.is_floating_point()))
        return tensors[0] if len(tensors) == 1 and len(outputs) == 1 else tensors

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(
                "Checkpointing is not compatible with .grad(), please use .backward() if possible"
            )
        with boundary(ctx.policy, "backward"):
            inputs = ctx.stash.restore()
            with ctx.rng.replayed(), torch.enable_grad():
                outputs = ctx.run_function(*inputs)
            if isinstance(outputs, torch.Tensor):
                outputs = (outputs,)
            pairs = [
                (o, g)
                for o, g in zip((o for o in outputs if isinstance(o, torch.Tensor)), grads)
                if o.requires_grad
            ]
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        ctx.stash = None  # the inputs (and their counted bytes) go now, not with the graph
        grads_in = [a.grad if isinstance(a, torch.Tensor) else None for a in inputs]
        return (None, None, *grads_in)


def checkpoint(function: Callable, *args: Any, **kwargs: Any):
    """Run ``function(*args, **kwargs)`` keeping only its arguments for the backward, which
    recomputes it. Tensors passed by keyword take part in autograd as positional ones do.
    Returns what ``function`` returned (non-tensor outputs included)."""
    if kwargs:
        positional, keys, inner = len(args), tuple(kwargs), function

        def function(*all_args):
            return inner(*all_args[:positional], **dict(zip(keys, all_args[positional:])))

        args = args + tuple(kwargs.values())
    all_outputs: list = []
    _grad_enabled[0] = torch.is_grad_enabled()
    CheckpointFunction.apply(function, all_outputs, *args)
    return all_outputs[0] if len(all_outputs) == 1 else tuple(all_outputs)
