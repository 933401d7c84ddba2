"""One script, run against any module with DeepSpeed's checkpointing API (``deepspeed.
checkpointing``: DeepSpeed's own, this project's namespace, or None for plain PyTorch): a tiny
Megatron-style stack whose layers are checkpointed, with dropout drawn from the default
generator and from the model-parallel tracker's state (as Megatron's tensor-parallel regions
draw it). Prints (as a subprocess) or returns the losses and gradients of a few steps."""

from __future__ import annotations

import contextlib
import json
import sys

import torch

LAYERS, HIDDEN, BATCH, STEPS = 4, 16, 6, 3


class OneRankMpu:
    """A model-parallel unit of one rank (DeepSpeed's seeding reads it)."""

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_group(self):
        return None

    def get_data_parallel_rank(self) -> int:
        return 0


class Layer(torch.nn.Module):
    def __init__(self, tracker) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(HIDDEN, 2 * HIDDEN)
        self.fc2 = torch.nn.Linear(2 * HIDDEN, HIDDEN)
        self.tracker = tracker

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.fc1(x))
        fork = self.tracker.fork() if self.tracker is not None else contextlib.nullcontext()
        with fork:  # the model-parallel region's dropout
            h = torch.nn.functional.dropout(h, 0.2, training=True)
        out = self.fc2(h) * scale
        return x + torch.nn.functional.dropout(out, 0.1, training=True)


def run(checkpointing, mode: str = "reentrant", config: dict | None = None) -> dict:
    """``checkpointing``: the API module (its tracker seeded and used), or None (no tracker).
    ``mode``: "reentrant" (``checkpoint``), "non_reentrant", "torch" (torch.utils.checkpoint,
    reentrant) or "plain" (no checkpoint: the reference)."""
    torch.manual_seed(0)
    tracker = None
    if checkpointing is not None:
        checkpointing.configure(OneRankMpu(), deepspeed_config=config)
        checkpointing.model_parallel_cuda_manual_seed(1234)
        tracker = checkpointing.get_cuda_rng_tracker()
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(Layer(tracker) for _ in range(LAYERS))
    embed, head = torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Linear(HIDDEN, 1)
    losses, grads = [], []
    for _ in range(STEPS):
        x = embed(torch.randn(BATCH, HIDDEN))  # requires grad: the reentrant rule's input
        for layer in layers:
            if mode == "plain":
                x = layer(x, 0.5)
            elif mode == "torch":
                x = torch.utils.checkpoint.checkpoint(layer, x, 0.5, use_reentrant=True)
            elif mode == "non_reentrant":
                x = checkpointing.non_reentrant_checkpoint(layer, x, 0.5)
            else:
                x = checkpointing.checkpoint(layer, x, 0.5)
        loss = head(x).pow(2).mean()
        loss.backward()
        losses.append(loss.item())
        grads.append(
            [p.grad.flatten().tolist() for p in [*embed.parameters(), *layers.parameters()]]
        )
        for p in [*embed.parameters(), *layers.parameters(), *head.parameters()]:
            p.grad = None
    return {"losses": losses, "grads": grads}


if __name__ == "__main__":
    import deepspeed

    # DeepSpeed's configure logs through its comm module: a process group of one (the caller
    # sets MASTER_ADDR/MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK).
    deepspeed.init_distributed(dist_backend="gloo")
    mode, config = sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else None
    print("RESULT" + json.dumps(run(deepspeed.checkpointing, mode, config)))
