"""Muon's math on one whole matrix (Keller Jordan's published algorithm, as DeepSpeed runs it):
momentum, Nesterov's look-ahead, the Newton-Schulz orthogonalization ("standard" quintic or
"gram", which iterates on the small Gram matrix) and the shape scale.

The iterations run in fp32 on whatever device holds the matrix (DeepSpeed casts to bf16/fp16
where the accelerator has them; fp32 keeps the update equal to a plain PyTorch reference).
"""

from __future__ import annotations

import torch

NS_METHODS = ("gram", "standard")
NS_STEPS = 5  # DeepSpeed's muon_update default, never configurable there
_A, _B, _C = 3.4445, -4.7750, 2.0315  # the quintic's coefficients (maximal slope at zero)


def _normalized(g: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """fp32, wide (rows <= cols) and of spectral norm at most 1; True when transposed."""
    x = g.float()
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    return x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7), tall


def newton_schulz_standard(g: torch.Tensor, steps: int = NS_STEPS) -> torch.Tensor:
    x, tall = _normalized(g)
    for _ in range(steps):
        a = x @ x.mT
        b = _B * a + _C * a @ a
        x = _A * x + b @ x
    return x.mT if tall else x


def newton_schulz_gram(g: torch.Tensor, steps: int = NS_STEPS) -> torch.Tensor:
    """The same polynomial applied through R = X X^T (n x n, n <= m), restarted once at
    iteration 2 (as DeepSpeed's ``zeropower_via_gram_newtonschulz``); a square matrix takes
    the standard iteration (no saving)."""
    x, tall = _normalized(g)
    n, m = x.size(-2), x.size(-1)
    if m <= n:
        return newton_schulz_standard(g, steps)
    r, q, restart = x @ x.mT, None, 2
    for i in range(steps):
        if i == restart:
            x = q @ x
            r, q = x @ x.mT, None
        z = _B * r + _C * r @ r
        if q is None:
            q = z.clone()
            q.diagonal(dim1=-2, dim2=-1).add_(_A)
        else:
            q = _A * q + z @ q
        if i < steps - 1 and i + 1 != restart:
            rz = _A * r + z @ r
            r = _A * rz + z @ rz
    return x.mT @ q.mT if tall else q @ x


def orthogonalized(update: torch.Tensor, ns_method: str) -> torch.Tensor:
    """Muon's step direction for one param's (Nesterov) momentum, in the param's shape: a conv
    filter (4-d) is its first dimension by the rest; scaled by sqrt(max(1, rows / cols)) of
    the param's last two dimensions (the published algorithm's ``grad.size(-2) / size(-1)``)."""
    shape = update.shape
    mat = update.reshape(len(update), -1) if update.ndim == 4 else update
    ns = newton_schulz_gram if ns_method == "gram" else newton_schulz_standard
    out = ns(mat) * max(1.0, shape[-2] / shape[-1]) ** 0.5
    return out.reshape(shape)


def momentum_step(grad: torch.Tensor, buf: torch.Tensor, beta: float, out: torch.Tensor) -> None:
    """Elementwise (so exact on any shard): ``buf`` <- lerp(buf, grad, 1 - beta); ``out`` <- the
    Nesterov look-ahead lerp(grad, buf, beta), the matrix Newton-Schulz orthogonalizes."""
    buf.lerp_(grad, 1.0 - beta)
    torch.lerp(grad, buf, beta, out=out)
