"""One short two-rank training job for scripts/exit_loop.sh: stage 1 on one rank's worth of
a tiny model, a few steps, then exit the way user scripts do (no explicit teardown)."""

from __future__ import annotations

import sys

import torch

import zero_offload

stage = int(sys.argv[1]) if len(sys.argv) > 1 else 1
offload = len(sys.argv) > 2 and sys.argv[2] == "offload"
zero_offload.init_distributed()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
zero: dict = {"stage": stage, "reduce_bucket_size": 200, "overlap_comm": True}
if offload:
    zero["offload_optimizer"] = {"device": "cpu", "delayed_update": True}
engine, _, _, _ = zero_offload.initialize(
    model=model,
    config={
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": zero,
    },
)
for _ in range(5):
    x = torch.randn(4, 16)
    engine.backward(engine(x).pow(2).mean())
    engine.step()
print(f"rank {engine.global_rank} done")
