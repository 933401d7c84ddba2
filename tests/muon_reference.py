"""Muon as published (Keller Jordan's algorithm), written here from the paper's pseudocode for
the tests: one process, whole tensors, plain PyTorch. The engine's Muon must train like it."""

from __future__ import annotations

import torch

A, B, C = 3.4445, -4.7750, 2.0315


def orthogonalize(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Quintic Newton-Schulz on a 2-d matrix, in fp32, scaled by sqrt(max(1, rows / cols))."""
    x = g.float()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        a = x @ x.T
        x = A * x + (B * a + C * a @ a) @ x
    if tall:
        x = x.T
    return x * max(1.0, g.shape[0] / g.shape[1]) ** 0.5


class ReferenceMuon:
    """Muon (Nesterov momentum, Newton-Schulz, decoupled weight decay) for ``muon`` params and
    torch's AdamW for ``aux`` params, stepped together."""

    def __init__(
        self, muon, aux, lr, momentum, weight_decay, adam_lr, betas, eps, adamw: bool = True
    ) -> None:
        """``adamw`` false: the aux group is torch's Adam (L2 weight decay), as DeepSpeed's
        ``adam_w_mode: false``."""
        self.muon, self.lr, self.beta, self.wd = list(muon), lr, momentum, weight_decay
        self.bufs = [torch.zeros_like(p) for p in self.muon]
        aux_cls = torch.optim.AdamW if adamw else torch.optim.Adam
        self.adam = aux_cls(list(aux), lr=adam_lr, betas=betas, eps=eps, weight_decay=weight_decay)

    @torch.no_grad()
    def step(self) -> None:
        for p, buf in zip(self.muon, self.bufs):
            buf.lerp_(p.grad, 1 - self.beta)
            u = p.grad.lerp(buf, self.beta)
            p.mul_(1 - self.lr * self.wd).add_(orthogonalize(u), alpha=-self.lr)
        self.adam.step()

    def zero_grad(self) -> None:
        for p in self.muon:
            p.grad = None
        self.adam.zero_grad()
