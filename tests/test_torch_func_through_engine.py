"""``torch.func`` transforms called on the engine at stages 0-2 (``grad``, ``grad_and_value``,
``vmap(grad)``) give plain PyTorch's gradients with respect to the inputs, also with gradient
accumulation (no 1/gas scaling), and leave the engine's training untouched (a later
``engine.backward`` + ``step`` still matches plain PyTorch)."""

from __future__ import annotations

import copy

import pytest
import torch

import zero_offload


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x))).sum()


def _pair(stage: int, gas: int):
    torch.manual_seed(0)
    model = Tiny()
    plain = copy.deepcopy(model)
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": gas,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
    }
    return zero_offload.initialize(model=model, config=cfg)[0], plain


@pytest.mark.parametrize(("stage", "gas"), [(0, 1), (1, 1), (2, 1), (2, 4)])
def test_func_grad_matches_plain_pytorch(stage: int, gas: int) -> None:
    engine, plain = _pair(stage, gas)
    x = torch.randn(8)
    g, v = torch.func.grad_and_value(lambda xi: engine(xi))(x)
    g_ref, v_ref = torch.func.grad_and_value(lambda xi: plain(xi))(x)
    torch.testing.assert_close((g, v), (g_ref, v_ref))
    xs = torch.stack([x, x + 0.1, x - 0.1])
    batched = torch.func.vmap(torch.func.grad(lambda xi: engine(xi)))(xs)
    torch.testing.assert_close(batched, torch.func.vmap(torch.func.grad(lambda xi: plain(xi)))(xs))

    # training afterwards is unaffected: one step equals plain Adam's
    opt = torch.optim.Adam(plain.parameters(), lr=1e-2)
    for _ in range(gas):
        engine.backward(engine(x.unsqueeze(0)))
        plain(x.unsqueeze(0)).div(gas).backward()
        engine.step()
    opt.step()
    for p, p_ref in zip(engine.module.parameters(), plain.parameters()):
        torch.testing.assert_close(p, p_ref)
    engine.destroy()
