"""``zero-offload train --model PATH``: fine-tune a local Hugging Face causal LM folder
(config.json + safetensors, as ``save_pretrained`` writes it) on ``--data``, optionally with
LoRA adapters (``--lora``, via peft), under any ZeRO config. The run folder gets ``hf_model/``,
a ``save_pretrained`` folder ``AutoModelForCausalLM.from_pretrained`` loads (with ``--lora``,
the adapters merged in, and the adapter alone in ``hf_model_adapter/``)."""

from __future__ import annotations

import argparse
import os

from .job import GPT2_FLAGS, Job

EXPORT_DIR = "hf_model"
DEFAULT_SEQ_LENGTH = 128


def add_hf_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Hugging Face models (needs zero_offload[hf])")
    group.add_argument(
        "--model", metavar="PATH", help="a local Hugging Face causal LM folder to fine-tune"
    )
    group.add_argument("--lora", action="store_true", help="train LoRA adapters only (peft)")
    group.add_argument("--lora-r", type=int, default=8, help="LoRA rank (8)")
    group.add_argument("--lora-alpha", type=float, default=16, help="LoRA alpha (16)")
    group.add_argument("--lora-dropout", type=float, default=0.0, help="LoRA dropout (0)")
    group.add_argument(
        "--lora-targets",
        help="comma-separated module names to adapt (default: peft's for the model type)",
    )


def check_hf_arguments(args: argparse.Namespace) -> None:
    if args.model is None:
        if args.lora:
            raise ValueError("--lora needs --model (LoRA adapts a Hugging Face model)")
        return
    given = [f"--{n.replace('_', '-')}" for n in GPT2_FLAGS if getattr(args, n, None)]
    if given:
        raise ValueError(
            f"{', '.join(given)} set the built-in GPT-2's shape; --model {args.model} has its own"
        )


def hf_job(args: argparse.Namespace, ds_config: dict | None = None) -> Job:
    """``ds_config``: the run's config; at stage 3 the model is loaded straight into its
    partitions, at stages 0-2 in the training dtype (never a whole fp32 copy per rank)."""
    import torch

    from zero_offload.data import TokenBlockDataset, split_heldout
    from zero_offload.hf import CausalLMLoss, LoraSpec, apply_lora, hf_token_stream, load_causal_lm
    from zero_offload.models import param_groups

    spec = None
    if args.lora:
        targets = tuple(t for t in (args.lora_targets or "").split(",") if t) or None
        spec = LoraSpec(args.lora_r, args.lora_alpha, args.lora_dropout, targets)
    torch.manual_seed(args.seed)  # LoRA's initial adapters: the same on every rank
    dtype, zero3 = _load_plan(ds_config)
    hf_model = load_causal_lm(args.model, dtype, zero3)
    config = hf_model.config
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    seq = args.seq_length or min(DEFAULT_SEQ_LENGTH, limit or DEFAULT_SEQ_LENGTH)
    if limit is not None and seq > limit:
        raise ValueError(f"--seq-length {seq} exceeds the model's {limit} positions")
    tokens, note = hf_token_stream(args.model, args.data, args.max_bytes, config.vocab_size)
    train_tokens, heldout_tokens = split_heldout(tokens)
    if spec is not None:
        hf_model = apply_lora(hf_model, spec)
    model = CausalLMLoss(hf_model)
    numel = lambda p: getattr(p, "ds_numel", p.numel())  # noqa: E731 (stage 3: partitioned)
    total = sum(numel(p) for p in hf_model.parameters())
    trainable = sum(numel(p) for p in hf_model.parameters() if p.requires_grad)
    kind = getattr(config, "model_type", type(hf_model).__name__)
    lora_text = f", LoRA r={spec.r}: {trainable / 1e6:.3f}M trainable" if spec else ""

    def finish(engine, folder) -> list[str]:
        from zero_offload.hf.export import save_pretrained_streamed

        # Every rank: at stage 3 each module's params are gathered in turn (a collective) and
        # rank 0 writes them, sharded as save_pretrained does; no rank holds the whole model.
        return save_pretrained_streamed(engine, hf_model, os.path.join(folder.path, EXPORT_DIR))

    return Job(
        model=model,
        param_groups=param_groups(model),
        train_set=TokenBlockDataset(train_tokens, seq),
        heldout_set=TokenBlockDataset(heldout_tokens, seq),
        seq_length=seq,
        corpus_tokens=len(tokens),
        title=f"{kind} from {args.model} ({total / 1e6:.2f}M params{lora_text})",
        info={
            "path": os.path.abspath(args.model),
            "model_type": kind,
            "seq_length": seq,
            "lora": None if spec is None else {"r": spec.r, "alpha": spec.alpha},
            "trainable_parameters": trainable,
        },
        num_parameters=total,
        flops_per_token=None,
        notes=[note],
        finish=finish,
    )


def _load_plan(ds_config: dict | None):
    """(training dtype, the config for zero.Init at stage 3 else None)."""
    import torch

    if ds_config is None:
        return torch.float32, None
    import warnings

    from zero_offload.config import load_config
    from zero_offload.core import dist

    with warnings.catch_warnings():  # initialize() reports the config's warnings once
        warnings.simplefilter("ignore")
        cfg = load_config(ds_config, world_size=dist.world_size())
    return cfg.dtype, (ds_config if cfg.zero_optimization.stage == 3 else None)
