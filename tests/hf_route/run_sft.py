"""A TRL ``SFTTrainer`` script, run by the tests in a subprocess (alone or under torchrun):
``python run_sft.py SPEC.json``. Rank 0 prints ``RESULT <json>``.

SPEC: ``{"opt_in": "call" | "env" | "none", "model_dir": ..., "ds": {...} | null,
"args": {SFTConfig kwargs}}``. The model folder gets a character-level tokenizer (built here:
nothing is downloaded); the dataset is a small in-memory ``datasets.Dataset`` of text.
"""

from __future__ import annotations

import json
import os
import sys

SPEC = json.loads(open(sys.argv[1]).read())
if SPEC["opt_in"] == "call":
    import zero_offload

    zero_offload.as_deepspeed()

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

SPECIALS = ["<pad>", "<eos>", "<unk>"]


def char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer over printable ASCII (ids < 256, the tiny model's vocab)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    chars = [chr(c) for c in range(32, 127)]
    vocab = {t: i for i, t in enumerate(SPECIALS + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def texts(n: int) -> list[str]:
    g = torch.Generator().manual_seed(3)
    words = ["zero", "offload", "adam", "shard", "gather", "step", "rank", "loss", "grad"]
    out = []
    for _ in range(n):
        k = int(torch.randint(3, 7, (1,), generator=g))
        idx = torch.randint(0, len(words), (k,), generator=g).tolist()
        out.append(" ".join(words[i] for i in idx) + ".")
    return out


def main() -> None:
    tokenizer = char_tokenizer()
    data = Dataset.from_dict({"text": texts(32)})
    kwargs = dict(SPEC["args"])
    if kwargs.pop("cpu_bf16", False):
        # TrainingArguments accepts bf16 with DeepSpeed only where torch reports a bf16 GPU, and
        # use_cpu (its way out) turns DeepSpeed off; here the CPU stands in for the GPU.
        import transformers.training_args as ta

        ta.is_torch_bf16_gpu_available = lambda: True
    args = SFTConfig(**kwargs, deepspeed=SPEC.get("ds"), report_to=[], disable_tqdm=True)
    torch.manual_seed(0)
    trainer = SFTTrainer(
        model=SPEC["model_dir"],
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
    )
    after_load = [
        p.numel() == 0 and getattr(p, "ds_numel", 0) > 0 for p in trainer.model.parameters()
    ]
    trainer.train()
    history = trainer.state.log_history
    result = {
        "losses": [h["loss"] for h in history if "loss" in h],
        "engine": type(trainer.model_wrapped).__name__,
        "bf16": bool(args.bf16),
        "gradient_checkpointing": bool(args.gradient_checkpointing),
        "partitioned_after_load": bool(after_load) and all(after_load),
        "world_size": args.world_size,
    }
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
