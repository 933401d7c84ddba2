"""Host memory of loading a Hugging Face folder into a stage-3 engine, per rank, side by side:
the plain way (``from_pretrained`` in fp32 on every rank, then ``initialize``: what
``zero-offload train --model`` did before) against the partitioned load (``zero.Init`` build,
then each rank reads only its chunks from the memory-mapped safetensors).

Each mode runs in fresh processes (``--world`` gloo ranks on the CPU). The table gives each
rank's peak anonymous RSS (memory the process allocated: file pages of the memory-mapped
weights are not counted) and peak RSS, both above the level after imports, next to the engine's
own model-state bytes, and the ratio of the plain load's peak to the partitioned one's.

    python benchmarks/load_memory.py --hidden 1024 --layers 12 --world 2
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checkpoint_io import PeakMemory  # noqa: E402

CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "cpu"},
    },
}


def _rank(rank: int, world: int, port: int, mode: str, folder: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # fmt: skip
    torch.set_num_threads(1)
    import transformers  # noqa: F401 (imports before the baseline)

    import zero_offload
    from zero_offload.hf import load_causal_lm

    zero_offload.init_distributed()
    peak = PeakMemory()
    with peak:
        t0 = time.perf_counter()
        if mode == "plain":
            model = load_causal_lm(folder, torch.float32)  # the whole fp32 model, every rank
        else:
            model = load_causal_lm(folder, torch.bfloat16, CONFIG)
        engine, *_ = zero_offload.initialize(model=model, config=CONFIG)
        seconds = time.perf_counter() - t0
    states = sum(engine.memory_report().values())
    rss, anon = peak.delta
    queue.put((rank, anon, rss, states, seconds))
    engine.destroy()
    zero_offload.comm.barrier()


def _run(mode: str, folder: str, world: int) -> list[tuple]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [
        ctx.Process(target=_rank, args=(r, world, port, mode, folder, queue)) for r in range(world)
    ]
    for p in procs:
        p.start()
    out = [queue.get() for _ in range(world)]
    for p in procs:
        p.join()
    return sorted(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 256), tie_word_embeddings=False,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
        n = sum(p.numel() for p in model.parameters())
        model.save_pretrained(tmp, max_shard_size=f"{max(1, n * 2 // 3 // 2**20 + 1)}MB")
        del model
        shards = len([f for f in os.listdir(tmp) if f.endswith(".safetensors")])
        print(f"CPU: {platform.processor() or platform.machine()} ({os.cpu_count()} cores); "
              f"Llama {n / 1e6:.0f}M params, bf16 safetensors in {shards} shards; stage 3, "
              f"both offloads, {args.world} gloo ranks")  # fmt: skip
        rows = {mode: _run(mode, tmp, args.world) for mode in ("plain", "partitioned")}
    gib = 2**30
    print("| load | rank | peak anon RSS GiB | peak RSS GiB | engine model states GiB | s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for mode, rs in rows.items():
        for rank, anon, rss, states, secs in rs:
            print(f"| {mode} | {rank} | {anon / gib:.2f} | {rss / gib:.2f} | "
                  f"{states / gib:.2f} | {secs:.1f} |")  # fmt: skip
    plain = max(r[1] for r in rows["plain"])
    part = max(r[1] for r in rows["partitioned"])
    print(f"peak anon RSS, plain / partitioned: {plain / part:.2f}x")


if __name__ == "__main__":
    main()
