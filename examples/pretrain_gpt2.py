"""Pretrain a GPT-2 with the Megatron-LM flags that the ZeRO and ZeRO-Offload tutorials use.

    zero-offload launch --num_gpus 2 examples/pretrain_gpt2.py \\
        --model-parallel-size 1 --num-layers 4 --hidden-size 192 --num-attention-heads 6 \\
        --batch-size 8 --seq-length 128 --train-iters 100 --log-interval 10 \\
        --deepspeed --deepspeed_config configs/ds_zero_stage_2.config

The model code knows nothing of ZeRO: stage, offload and precision all come from the JSON config.
The data is the built-in byte-level corpus (the Python standard library's sources) unless
--data-path names text files or folders. Each rank trains on its own slice of the data.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

import zero_offload
from zero_offload.config import load_config
from zero_offload.data import TokenBlockDataset, load_corpus, split_heldout
from zero_offload.models import GPT2Config, GPT2Model, param_groups


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    model = parser.add_argument_group("model (Megatron-LM flags)")
    model.add_argument("--model-parallel-size", type=int, default=1)
    model.add_argument("--num-layers", type=int, default=4)
    model.add_argument("--hidden-size", type=int, default=192)
    model.add_argument("--num-attention-heads", type=int, default=6)
    model.add_argument("--seq-length", type=int, default=128)
    model.add_argument("--checkpoint-activations", action="store_true")
    train = parser.add_argument_group("training (Megatron-LM flags)")
    train.add_argument(
        "--batch-size", type=int, default=None, help="micro batch per GPU (the config decides)"
    )
    train.add_argument("--train-iters", type=int, default=100)
    # Used only when the DeepSpeed config has no "optimizer" / "scheduler" section: then, as in
    # Megatron-LM, the script builds AdamW and a warmup + decay schedule itself.
    train.add_argument("--lr", type=float, default=1e-3)
    train.add_argument("--weight-decay", type=float, default=0.01)
    train.add_argument("--warmup", type=float, default=0.01, help="fraction of --train-iters")
    train.add_argument(
        "--lr-decay-style", choices=("constant", "linear", "cosine"), default="cosine"
    )
    train.add_argument("--log-interval", type=int, default=10)
    train.add_argument("--seed", type=int, default=1234)
    train.add_argument("--data-path", nargs="+", default=None, help="text files or folders")
    # DeepSpeed's launcher passes --local_rank; torchrun sets LOCAL_RANK instead.
    parser.add_argument(
        "--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0))
    )
    zero_offload.add_config_arguments(parser)
    args = parser.parse_args(argv)
    if args.model_parallel_size != 1:
        parser.error(
            f"--model-parallel-size must be 1 (zero_offload is data parallel only), "
            f"got {args.model_parallel_size}"
        )
    if args.deepspeed_config is None:
        parser.error("--deepspeed_config is required (a DeepSpeed JSON config)")
    for flag in ("train_iters", "log_interval", "lr"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    if not 0.0 <= args.warmup < 1.0:
        parser.error(f"--warmup must be a fraction in [0, 1), got {args.warmup}")
    return args


def megatron_schedule(args: argparse.Namespace):
    """Linear warmup over ``--warmup`` of the iterations, then ``--lr-decay-style`` to 0:
    a factory the engine calls with its optimizer (DeepSpeed's ``lr_scheduler`` callable)."""
    warmup = int(args.warmup * args.train_iters)
    decay = max(1, args.train_iters - warmup)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / decay)
        if args.lr_decay_style == "linear":
            return 1.0 - progress
        if args.lr_decay_style == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def data_iterator(dataset: TokenBlockDataset, micro_batch: int, seed: int):
    """Endless micro-batches of this rank's slice of ``dataset``."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    sampler = DistributedSampler(dataset, world, rank, shuffle=True, seed=seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=micro_batch, sampler=sampler, drop_last=True)
    if len(loader) == 0:
        raise ValueError(f"too little data for one micro-batch of {micro_batch} per rank")
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def main(argv: list[str] | None = None) -> None:
    args = get_args(argv)
    zero_offload.init_distributed()
    torch.manual_seed(args.seed)  # every rank builds the same initial model
    config = GPT2Config(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        seq_length=args.seq_length,
        checkpoint_activations=args.checkpoint_activations,
    )
    model = GPT2Model(config)
    # The tutorials' configs carry no batch sizes: --batch-size is the micro batch per GPU, as in
    # Megatron-LM (a config that also sets train_micro_batch_size_per_gpu must agree with it).
    world = dist.get_world_size() if dist.is_initialized() else 1
    ds_config = load_config(args.deepspeed_config, world, micro_batch_size=args.batch_size)
    optimizer = lr_scheduler = None
    if ds_config.optimizer is None:
        optimizer = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr)
        if ds_config.scheduler is None:
            lr_scheduler = megatron_schedule(args)
    engine, _, _, _ = zero_offload.initialize(
        model=model,
        optimizer=optimizer,
        model_parameters=param_groups(model),
        lr_scheduler=lr_scheduler,
        config=ds_config,
    )
    rank0 = engine.global_rank == 0
    micro = engine.train_micro_batch_size_per_gpu()
    gas = engine.gradient_accumulation_steps()

    train_tokens, _ = split_heldout(load_corpus(args.data_path))
    batches = data_iterator(TokenBlockDataset(train_tokens, args.seq_length), micro, args.seed)
    tokens_per_iter = micro * gas * engine.world_size * args.seq_length
    if rank0:
        n = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # stage 3: shards
        print(
            f"GPT-2: {n / 1e6:.2f}M parameters, {engine.world_size} rank(s), micro batch "
            f"{micro} x {gas} accumulation steps, {tokens_per_iter} tokens per iteration"
        )

    engine.train()
    interval_loss, interval_start, last_logged = 0.0, time.perf_counter(), 0
    for iteration in range(1, args.train_iters + 1):
        for _ in range(gas):
            input_ids, labels = (t.to(engine.device) for t in next(batches))
            loss = engine(input_ids, labels)
            engine.backward(loss)
            engine.step()
            interval_loss += loss.item() / gas
        if iteration % args.log_interval == 0 or iteration == args.train_iters:
            steps, last_logged = iteration - last_logged, iteration
            total = torch.tensor([interval_loss], dtype=torch.float64, device=engine.device)
            if dist.is_initialized():
                dist.all_reduce(total)
            elapsed = time.perf_counter() - interval_start
            if rank0:
                print(
                    f" iteration {iteration:8d}/{args.train_iters:8d} |"
                    f" elapsed time per iteration (ms): {1000 * elapsed / steps:.1f} |"
                    f" learning rate: {engine.get_lr()[0]:.3E} |"
                    f" lm loss: {total.item() / (steps * engine.world_size):.6E} |"
                    f" loss scale: {engine.loss_scale:.1f} |"
                    f" tokens/s: {tokens_per_iter * steps / elapsed:.0f}",
                    flush=True,
                )
            interval_loss, interval_start = 0.0, time.perf_counter()
    if rank0:
        print("training done", flush=True)


if __name__ == "__main__":
    main()
