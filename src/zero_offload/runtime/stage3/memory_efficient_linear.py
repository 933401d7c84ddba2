"""Stage 3: ``nn.Linear`` layers whose backward does not keep the gathered weight alive.

Autograd's own linear saves ``weight.t()``, a view of the gathered bucket: the bucket then stays
in memory from the forward to the layer's backward, whatever the store released, so the end of
a forward holds every gathered weight (2 bytes/param in 16-bit training: the whole model). The
function here saves the weight *parameter* instead (a leaf: autograd keeps the tensor object,
not its storage), so a released slot's memory is freed at once, and the backward reads the
parameter as gathered again by the fetch schedule (or gathers it itself for a read from outside
the module that owns it, as DeepSpeed's ``LinearFunctionForZeroStage3`` does).

DeepSpeed's ``zero_optimization.memory_efficient_linear`` (default true) turns it on; the engine
swaps the ``forward`` of each ``nn.Linear`` instance (``attach``) and restores it (``detach``).
Under autocast the layer runs its own forward (the saving is skipped, the values are the same).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...core import host_memory, partitioned
from ...core.status import ZeroParamStatus


class Zero3Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias):  # noqa: A002 (torch's name)
        ctx.save_for_backward(input, weight, bias)
        return F.linear(input, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        input, weight, bias = ctx.saved_tensors  # noqa: A001
        store = partitioned.store_of(weight)
        gathered_here = None
        if store is not None and weight.ds_status is ZeroParamStatus.NOT_AVAILABLE:
            gathered_here = partitioned.slot_of(weight)
            store.fetch([gathered_here])
        try:
            grad_input = grad_weight = grad_bias = None
            if ctx.needs_input_grad[0]:
                grad_input = grad.matmul(weight)
            if ctx.needs_input_grad[1]:
                g2 = grad.reshape(-1, grad.shape[-1])
                grad_weight = _weight_grad(g2, input.reshape(-1, input.shape[-1]))
            if bias is not None and ctx.needs_input_grad[2]:
                grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0)
            return grad_input, grad_weight, grad_bias
        finally:
            if gathered_here is not None:
                store.release(gathered_here)


def _weight_grad(g2: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """``g2.t() @ x2``, the weight's gradient. On a CPU, from ``host_memory.MAP_MIN_BYTES`` up,
    it is written into a mapping of its own (the same product, ``mm`` with ``out=``): the
    gradient is freed once the reducer has taken it, and a block of malloc's would stay resident
    as free heap (core/host_memory.py). Not under grad mode (a double backward records ops)."""
    rows, cols = g2.shape[1], x2.shape[1]
    if (
        g2.device.type != "cpu"
        or torch.is_grad_enabled()
        or g2.dtype != x2.dtype
        or not host_memory.maps(rows * cols, g2.dtype)
    ):
        return g2.t().matmul(x2)
    out = host_memory.mapped(rows * cols, g2.dtype).view(rows, cols)
    return torch.mm(g2.t(), x2, out=out)


class _Zero3Forward:
    """The ``forward`` the engine gives one ``nn.Linear`` instance: picklable and copyable with
    its module (a plain bound function is not), and recognised by ``detach``."""

    def __init__(self, layer: torch.nn.Linear) -> None:
        self.layer = layer

    def __call__(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002
        m = self.layer
        if torch.is_autocast_enabled(input.device.type) or input.dim() == 0:
            return F.linear(input, m.weight, m.bias)
        return Zero3Linear.apply(input, m.weight, m.bias)


def attach(module: torch.nn.Module) -> list[torch.nn.Linear]:
    """Every ``nn.Linear`` of ``module`` (exactly that class: a subclass may compute otherwise;
    an instance whose forward was already replaced keeps it) runs through
    :class:`Zero3Linear`; returns them for :func:`detach`."""
    out = []
    for m in module.modules():
        if type(m) is torch.nn.Linear and "forward" not in m.__dict__:
            m.forward = _Zero3Forward(m)
            out.append(m)
    return out


def detach(layers: list[torch.nn.Linear]) -> None:
    """Undo :func:`attach` (a forward someone else installed since is left alone)."""
    for m in layers:
        if isinstance(m.__dict__.get("forward"), _Zero3Forward):
            del m.__dict__["forward"]
