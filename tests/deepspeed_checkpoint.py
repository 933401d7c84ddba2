"""Make a DeepSpeed checkpoint with DeepSpeed itself (on the CPU), for the converter's tests.

    python tests/deepspeed_checkpoint.py OUT --stage 2 --dtype fp32 [--offload] [--steps 2]

Trains the parity model (tests/parity.py: tied embedding, a frozen and an unused param) for
--steps optimizer steps with gradient accumulation 2 and a WarmupLR schedule, saves with
``engine.save_checkpoint(OUT)``, and writes ``OUT/expected.pt``: the fp32 master weights per param (DeepSpeed's
``safe_get_full_fp32_param``), the step, the scheduler state and the
next batch's loss, which a converted checkpoint must reproduce. One process, gloo; DeepSpeed is
imported only here, in a subprocess of the test.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    ap.add_argument("--offload", action="store_true")
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args(argv)

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for k, v in {
        "MASTER_ADDR": "127.0.0.1",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
    }.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 2000))
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param
    from parity import batches, make_model

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    zero = {"stage": args.stage, "reduce_bucket_size": 200, "allgather_bucket_size": 200}
    if args.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
        },
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 5}},
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**6,
    }
    if args.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if args.dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    model = make_model()
    groups = [
        {"params": [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]},
        {
            "params": [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2],
            "weight_decay": 0.0,
        },
    ]
    engine, _, _, sched = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)
    data = batches(args.steps + 1, 1, 2, 2)
    dtype = engine.module.l1.weight.dtype
    for x, y in data[: args.steps]:
        for k in range(2):
            loss = engine(x[2 * k : 2 * k + 2], y[2 * k : 2 * k + 2])
            engine.backward(loss)
            engine.step()
    engine.save_checkpoint(args.out)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    def master(p: torch.nn.Parameter) -> torch.Tensor:
        full = safe_get_full_fp32_param(p)  # None without ZeRO: the param is the master
        return (p.detach().float() if full is None else full).cpu().clone()

    expected = {
        "master": {n: master(p) for n, p in named},
        "global_steps": engine.global_steps,
        "lr": [g["lr"] for g in engine.optimizer.param_groups],
        "scheduler": sched.state_dict(),
        "dtype": str(dtype),
    }
    # The next step, continued by DeepSpeed: the converted checkpoint must reproduce it.
    x, y = data[args.steps]
    for k in range(2):
        loss = engine(x[2 * k : 2 * k + 2], y[2 * k : 2 * k + 2])
        engine.backward(loss)
        engine.step()
    expected["next_master"] = {n: master(p) for n, p in named}
    torch.save(expected, os.path.join(args.out, "expected.pt"))


if __name__ == "__main__":
    main()
