"""A DeepSpeed training script, run by the launcher tests: ``train_ds.py --deepspeed ds.json
--out OUT.json`` under a launcher (``import deepspeed`` is zero_offload's namespace through the
opt-in), or ``--plain`` in one process without either library (the reference: the same model,
data and AdamW on the whole global batch). Rank 0 writes ``{"losses": [...], "world": W,
"nodes": [GROUP_RANK of each rank]}`` to OUT.json."""

from __future__ import annotations

import argparse
import json
import os

import torch

STEPS, GLOBAL_BATCH, LR, CLIP = 4, 4, 1e-2, 1.0  # CLIP: the config's gradient_clipping


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(GLOBAL_BATCH, 5, generator=g), torch.randn(GLOBAL_BATCH, 2, generator=g))
        for _ in range(STEPS)
    ]


def plain() -> dict:
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for x, y in data():
        loss = torch.nn.functional.mse_loss(m(x), y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP)
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "world": 1, "nodes": [0]}


def distributed(config: str) -> dict:
    import deepspeed

    deepspeed.init_distributed()
    engine, *_ = deepspeed.initialize(model=model(), config=config)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    share = GLOBAL_BATCH // world
    losses = []
    for x, y in data():
        xs, ys = x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]
        loss = torch.nn.functional.mse_loss(engine(xs), ys)
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
    nodes = [None] * world
    torch.distributed.all_gather_object(nodes, int(os.environ.get("GROUP_RANK", "0")))
    return {"losses": losses, "world": world, "nodes": nodes, "engine": type(engine).__name__}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed", default=None)
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = plain() if args.plain else distributed(args.deepspeed)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
