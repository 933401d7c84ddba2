"""What the main job trains: the built-in GPT-2 on byte tokens, or a Hugging Face causal LM
(``--model``, see hf.py). Everything the training loop and the run folder need to know
about the model is in a :class:`Job`."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Job:
    model: Any  # torch.nn.Module: forward(input_ids, labels) -> mean loss
    param_groups: list[dict[str, Any]]
    train_set: Any
    heldout_set: Any
    seq_length: int
    corpus_tokens: int
    title: str  # "GPT-2 2x64 (0.10M params)"
    info: dict[str, Any]  # run.json's "model"
    num_parameters: int
    flops_per_token: float | None
    notes: list[str] = field(default_factory=list)
    # Called on every rank after the held-out evaluation; returns the paths it wrote (rank 0).
    finish: Callable[[Any, Any], list[str]] | None = None


GPT2_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "checkpoint_activations")


def model_config(args: argparse.Namespace):
    from zero_offload.models import GPT2Config

    overrides = {
        name: getattr(args, name)
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length")
        if getattr(args, name) is not None
    }
    if args.checkpoint_activations:
        overrides["checkpoint_activations"] = True
    return GPT2Config.preset(args.preset, **overrides)


def gpt2_job(args: argparse.Namespace) -> Job:
    import torch

    from zero_offload.data import TokenBlockDataset, load_corpus, split_heldout
    from zero_offload.models import GPT2Model, flops_per_token, num_parameters, param_groups

    mcfg = model_config(args)
    tokens = load_corpus(args.data, args.max_bytes)
    train_tokens, heldout_tokens = split_heldout(tokens)
    train_set = TokenBlockDataset(train_tokens, mcfg.seq_length)
    heldout_set = TokenBlockDataset(heldout_tokens, mcfg.seq_length)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = GPT2Model(mcfg)
    n = num_parameters(mcfg)
    return Job(
        model=model,
        param_groups=param_groups(model),
        train_set=train_set,
        heldout_set=heldout_set,
        seq_length=mcfg.seq_length,
        corpus_tokens=len(tokens),
        title=f"GPT-2 {mcfg.num_layers}x{mcfg.hidden_size} ({n / 1e6:.2f}M params)",
        info=mcfg.to_dict(),
        num_parameters=n,
        flops_per_token=flops_per_token(mcfg),
    )
