"""Token streams for a Hugging Face model: its own tokenizer when the model folder has one,
else bytes (token ids 0-255), which any model with a vocabulary of at least 256 can learn."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..data import load_corpus

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def has_tokenizer(path: str | os.PathLike[str]) -> bool:
    return any((Path(path) / name).is_file() for name in _TOKENIZER_FILES)


def hf_token_stream(
    model_path: str | os.PathLike[str],
    data: list[str] | None,
    max_bytes: int,
    vocab_size: int,
) -> tuple[torch.Tensor, str]:
    """(1-D int64 tokens, a note saying how the text was tokenized)."""
    text = load_corpus(data, max_bytes)
    if has_tokenizer(model_path):
        from .deps import require_transformers

        tokenizer = require_transformers().AutoTokenizer.from_pretrained(
            str(model_path), local_files_only=True
        )
        ids = tokenizer(bytes(text.numpy()).decode("utf-8", errors="replace"))["input_ids"]
        return torch.tensor(ids, dtype=torch.long), f"tokenized with {model_path}'s tokenizer"
    if vocab_size < 256:
        raise ValueError(
            f"--model has no tokenizer and a vocabulary of {vocab_size} < 256, so byte-level "
            "tokens do not fit; add the tokenizer files (tokenizer.save_pretrained) to the folder"
        )
    return text.long(), "no tokenizer in the model folder: byte-level tokens (ids 0-255)"
