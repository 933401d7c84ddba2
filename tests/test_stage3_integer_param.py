"""Stage 3 with a param no group trains and that is not floating point (an int8 weight kept
as a Parameter, as quantized layers do): it stays a plain module param, the floating-point
params are partitioned and train as plain PyTorch does."""

from __future__ import annotations

import copy

import pytest
import torch

import zero_offload

pytestmark = pytest.mark.usefixtures("one_rank")


class Quantized(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(8, 16)
        self.codes = torch.nn.Parameter(
            torch.randint(-127, 127, (16, 16), dtype=torch.int8), requires_grad=False
        )
        self.out = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.out(h @ (self.codes.float() / 127.0))


def test_an_untrained_int8_param_at_stage3():
    model = Quantized()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(
        [p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01
    )
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    trained = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = zero_offload.initialize(model=model, model_parameters=trained, config=cfg)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
        opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        opt.step()
    assert engine.module.inp.weight.numel() == 0  # partitioned between steps
    assert torch.equal(engine.module.codes, ref.codes)
    with zero_offload.zero.GatheredParameters(list(engine.module.parameters())):
        want = dict(ref.named_parameters())
        for name, a in engine.module.named_parameters():
            assert torch.allclose(a.float(), want[name].float(), atol=1e-3), (
                name
            )  # the parity tests' bound
    engine.destroy()
