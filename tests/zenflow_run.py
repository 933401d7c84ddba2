"""Train a tiny fp32 model with ZenFlow, under DeepSpeed itself or this project, and save the
params after every ``step()``: the parity tests compare the two runs.

    python tests/zenflow_run.py OUT --impl deepspeed|zero_offload [--overlap] [--steps 6]

One process, gloo, on the CPU. DeepSpeed is imported only with ``--impl deepspeed`` (a
subprocess of the test), so the project's run never sees DeepSpeed's modules.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

TOPK = {
    "topk_ratio": 0.25,
    "select_strategy": "step",
    "select_interval": 2,
    "update_interval": 2,
    "full_warm_up_rounds": 0,
    "overlap_step": False,
}


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 12),
        torch.nn.Tanh(),
        torch.nn.Linear(12, 4),
    )


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(n)]


def config(zenflow: dict | None, clip: float = 0.0) -> dict:
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    if zenflow is not None:
        zero["zenflow"] = zenflow
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
        },
        "gradient_clipping": clip,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**6,
    }


def train(initialize, cfg: dict, steps: int) -> list[list[torch.Tensor]]:
    model = make_model()
    engine, _, _, _ = initialize(model=model, model_parameters=model.parameters(), config=cfg)
    out = []
    for x, y in batches(steps):
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        out.append([p.detach().clone().float() for p in engine.module.parameters()])
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--impl", choices=["deepspeed", "zero_offload"], required=True)
    ap.add_argument("--zenflow", default=json.dumps(TOPK))
    ap.add_argument("--clip", type=float, default=0.0)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args(argv)
    for k, v in {
        "MASTER_ADDR": "127.0.0.1",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
    }.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 2000))
    torch.set_num_threads(1)
    cfg = config(json.loads(args.zenflow), args.clip)
    if args.impl == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        initialize = deepspeed.initialize
    else:
        import zero_offload

        initialize = zero_offload.initialize
    torch.save(train(initialize, cfg, args.steps), args.out)


if __name__ == "__main__":
    main()
