"""DeepSpeed's TestZeroToFP32: after training, ``load_state_dict_from_zero_checkpoint`` on the
engine's own module (inside ``GatheredParameters`` at stage 3) gives the trained params, in the
module's dtype (bf16 here: the fp32 masters were cast to fp32 before, so every trained param
differed from the module's by its rounding)."""

from __future__ import annotations

import pytest
import torch

import zero_offload as deepspeed
from zero_offload.utils.zero_to_fp32 import load_state_dict_from_zero_checkpoint


class Layers(torch.nn.Module):
    def __init__(self, freeze: bool) -> None:
        super().__init__()
        self.ll = torch.nn.ModuleList(torch.nn.Linear(3, 3) for _ in range(2))
        self.classifier = torch.nn.Linear(4, 1)  # unused: 53 elements in all, uneven
        if freeze:
            self.ll[0].requires_grad_(False)

    def forward(self, x, y):
        for layer in self.ll:
            x = layer(x)
        return torch.nn.functional.cross_entropy(x.float(), y)


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("freeze", [False, True])
def test_loaded_fp32_weights_equal_the_trained_params(tmp_path, stage: int, freeze: bool) -> None:
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
    }
    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(config=cfg, model=Layers(freeze))
    if stage == 3:
        assert all(p.numel() == 0 for p in engine.module.parameters())
    torch.manual_seed(1)
    for _ in range(8):
        loss = engine(torch.randn(2, 3).bfloat16(), torch.randint(0, 3, (2,)))
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(str(tmp_path))
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        trained = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        model = load_state_dict_from_zero_checkpoint(engine.module, str(tmp_path))
        loaded = {n: v.clone() for n, v in model.state_dict().items()}
    for name, value in trained.items():
        assert loaded[name].dtype == torch.bfloat16
        assert torch.equal(loaded[name], value), name
    engine.destroy()
