"""Fine-tune a Hugging Face causal LM with ZeRO-Offload: the DeepSpeed blog's loop, unchanged
except for the import line.

    python examples/finetune_hf.py --model PATH --data my_texts/ --steps 100
    zero-offload launch --num_gpus 2 examples/finetune_hf.py --model PATH

PATH is a local folder as ``save_pretrained`` writes it (config.json + safetensors, and the
tokenizer's files if it has one; without them the text is fed as bytes, which needs a vocabulary
of at least 256). With no --model a tiny Llama is built from a config (nothing is downloaded), so
the script runs as written. The config is the blog's: ZeRO stage 2, optimizer state and step on
the CPU, fp16 (on a GPU; on a CPU-only machine fp32, since CPUs have no fast fp16 matmul).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

import zero_offload as deepspeed
from zero_offload.data import load_corpus

ds_config = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 5e-5}},
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "reduce_scatter": True,
        "reduce_bucket_size": 2e8,
        "overlap_comm": True,
        "contiguous_gradients": True,
    },
    "fp16": {"enabled": torch.cuda.is_available()},
    "gradient_clipping": 1.0,
}


class TextBlocks(Dataset):
    """Blocks of ``seq_length`` tokens as the blog's batches: input_ids and attention_mask."""

    def __init__(self, ids: torch.Tensor, seq_length: int) -> None:
        self.blocks = ids[: len(ids) // seq_length * seq_length].view(-1, seq_length)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i], "attention_mask": torch.ones_like(self.blocks[i])}


def tiny_llama(folder: str) -> str:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def tokenize(model_path: str, data: list[str] | None, max_bytes: int) -> torch.Tensor:
    text = load_corpus(data, max_bytes)
    if os.path.exists(os.path.join(model_path, "tokenizer_config.json")):
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        return torch.tensor(tokenizer(bytes(text.numpy()).decode("utf-8", "replace"))["input_ids"])
    return text.long()  # byte-level tokens


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="local Hugging Face model folder (default: a tiny Llama)")
    parser.add_argument("--data", nargs="+", help="text files or folders (default: built-in)")
    parser.add_argument("--max-bytes", type=int, default=1 << 20)
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out", default="finetuned", help="where save_pretrained writes")
    args = parser.parse_args(argv)

    deepspeed.init_distributed()
    with tempfile.TemporaryDirectory() as scratch:
        path = args.model or tiny_llama(os.path.join(scratch, "tiny-llama"))
        model = AutoModelForCausalLM.from_pretrained(path)
        dataset = TextBlocks(tokenize(path, args.data, args.max_bytes), args.seq_length)

    # Initialize DeepSpeed
    model_engine, optimizer, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config
    )
    sampler = DistributedSampler(
        dataset, deepspeed.comm.get_world_size(), deepspeed.comm.get_rank(), shuffle=True
    )
    loader = DataLoader(
        dataset, batch_size=model_engine.train_micro_batch_size_per_gpu(), sampler=sampler
    )

    # Training loop
    step, loss = 0, torch.tensor(float("nan"))
    while step < args.steps:
        for batch in loader:
            input_ids = batch["input_ids"].to(model_engine.device)
            attention_mask = batch["attention_mask"].to(model_engine.device)
            # Forward pass
            outputs = model_engine(
                input_ids=input_ids, attention_mask=attention_mask, labels=input_ids
            )
            # Compute the loss
            loss = outputs.loss
            # Backward pass
            model_engine.backward(loss)
            # Step the optimizer
            model_engine.step()
            step += 1
            if deepspeed.comm.get_rank() == 0 and (step % 10 == 0 or step == args.steps):
                print(f"step {step} loss {loss.item():.4f}")
            if step == args.steps:
                break

    # Save the model: a save_pretrained folder from_pretrained loads. Every rank gathers (at
    # ZeRO stage 3 the weights are partitioned; at stages 0-2 this does nothing), rank 0 writes.
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        if deepspeed.comm.get_rank() == 0:
            model.save_pretrained(args.out)
            print(f"saved to {args.out}")
    return float(loss.detach())


if __name__ == "__main__":
    main()
