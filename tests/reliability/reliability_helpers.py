"""A tiny model and config for the reliability tests."""

from __future__ import annotations

import torch


class Net(torch.nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.a = torch.nn.Linear(width, width)
        self.b = torch.nn.Linear(width, 1)
        self.register_buffer("running", torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return (self.b(h + self.running.to(h.dtype)) ** 2).mean()  # buffers stay fp32


def net(seed: int = 0, width: int = 8) -> Net:
    torch.manual_seed(seed)
    return Net(width)


def config(stage: int = 0, offload: bool = False, dtype: str = "fp32", **extra) -> dict:
    zero: dict = {"stage": stage, "reduce_bucket_size": 50, "allgather_bucket_size": 50}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    cfg: dict = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": zero,
        "gradient_clipping": 0.0,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 4}
    cfg.update(extra)
    return cfg


def engine(stage: int = 0, offload: bool = False, dtype: str = "fp32", seed: int = 0, **extra):
    import zero_offload

    eng, _, _, _ = zero_offload.initialize(
        model=net(seed), config=config(stage, offload, dtype, **extra)
    )
    return eng


def batch(seed: int = 1, width: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, width, generator=g)
