"""A plain Hugging Face ``Trainer`` script, trained by zero_offload through ``--deepspeed``.

    python examples/hf_trainer.py                                   # tiny built-in Llama, CPU ok
    python examples/hf_trainer.py --model PATH --deepspeed configs/hf_zero3_offload.json
    torchrun --nproc_per_node 2 examples/hf_trainer.py --steps 20   # two ranks (gloo on a CPU)

The first two lines below opt in: from then on ``import deepspeed`` (which transformers and
accelerate do) is zero_offload. An existing Trainer script needs no edit at all: run it with
``ZERO_OFFLOAD_AS_DEEPSPEED=1`` in the environment instead, e.g.
``ZERO_OFFLOAD_AS_DEEPSPEED=1 torchrun --nproc_per_node 8 train.py --deepspeed ds.json``.

PATH is a local folder as ``save_pretrained`` writes it (with its tokenizer's files; without
them the text is fed as bytes, which needs a vocabulary of at least 256). With no --model a tiny
Llama is built from a config (nothing is downloaded). The text is --data files or folders, or
by default the Python standard library's own sources. The default config is ZeRO stage 3 with
the optimizer and the params offloaded to the CPU; the Trainer fills its "auto" values.
"""

import zero_offload

zero_offload.as_deepspeed()  # before transformers is imported

import argparse  # noqa: E402
import os  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    Trainer,
    TrainingArguments,
)

from zero_offload.data import load_corpus  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CONFIG = os.path.join(HERE, "..", "configs", "hf_zero3_offload.json")


class TextBlocks(Dataset):
    """Blocks of ``seq_length`` tokens, each its own label (causal LM)."""

    def __init__(self, ids: torch.Tensor, seq_length: int) -> None:
        self.blocks = ids[: len(ids) // seq_length * seq_length].view(-1, seq_length)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def tiny_llama(folder: str) -> str:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def token_ids(model_path: str, data: list[str] | None, max_bytes: int) -> torch.Tensor:
    text = load_corpus(data, max_bytes)
    if os.path.exists(os.path.join(model_path, "tokenizer_config.json")):
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        return torch.tensor(tokenizer(bytes(text.numpy()).decode("utf-8", "replace"))["input_ids"])
    return text.long()  # byte-level tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a save_pretrained folder (default: a tiny Llama)")
    parser.add_argument("--data", nargs="*", help="text files or folders (default: stdlib)")
    parser.add_argument("--deepspeed", default=DEFAULT_CONFIG, help="DeepSpeed JSON config")
    parser.add_argument("--output_dir", default=None)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch_size", type=int, default=2, help="per device")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--seq_length", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--bf16", action="store_true")
    args = parser.parse_args()

    output_dir = args.output_dir or os.path.join(tempfile.gettempdir(), "zero_offload_hf_trainer")
    rank = os.environ.get("RANK", "0")  # each rank builds its own copy (same seed, same weights)
    model_path = args.model or tiny_llama(os.path.join(output_dir, f"tiny-llama-rank{rank}"))
    # Before the model is loaded, so that with ZeRO-3 from_pretrained builds it partitioned.
    training_args = TrainingArguments(
        output_dir=output_dir,
        deepspeed=args.deepspeed,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        max_steps=args.steps,
        learning_rate=args.lr,
        logging_steps=1,
        save_strategy="no",
        bf16=args.bf16,
        report_to=[],
    )
    model = AutoModelForCausalLM.from_pretrained(model_path)
    ids = token_ids(model_path, args.data, max_bytes=1 << 20)
    trainer = Trainer(
        model=model, args=training_args, train_dataset=TextBlocks(ids, args.seq_length)
    )
    trainer.train()
    trainer.save_model(os.path.join(output_dir, "final"))  # gathers a ZeRO-3 model's weights
    if trainer.is_world_process_zero():
        engine = type(trainer.model_wrapped)
        print(f"trained by {engine.__module__}.{engine.__name__}; model in {output_dir}/final")


if __name__ == "__main__":
    main()
