"""GPT-2 in the shape of the Megatron-LM GPT-2 that the ZeRO tutorials train.

Pre-LN transformer blocks with a fused qkv projection, learned position embeddings and an LM head
that is the token embedding itself (one Parameter, so ZeRO flattens and updates it once).
Labels are expected already shifted (``labels[t]`` is the token after ``input_ids[t]``), as in
Megatron; :class:`zero_offload.data.TokenBlockDataset` produces such pairs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import activation_checkpointing as ds_checkpointing
from ..core import partitioned


def _recompute(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A checkpointed layer: torch's non-reentrant checkpoint, or with ``deepspeed.
    checkpointing``'s ``cpu_checkpointing`` that API's (its input waits in host memory; it is
    reentrant, so it needs an input that requires grad, as the embeddings' output does)."""
    if ds_checkpointing.policy().cpu_checkpointing and x.requires_grad:
        return ds_checkpointing.checkpoint(layer, x)
    return checkpoint(layer, x, use_reentrant=False)


# Named sizes. The large ones are the tutorials' models (Megatron flags --num-layers,
# --hidden-size, --num-attention-heads) with GPT-2's 50257-token BPE vocabulary, so that
# `zero-offload estimate` reports the sizes the tutorials quote; the byte-level corpus uses 256.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64),
    "small": dict(num_layers=4, hidden_size=192, num_attention_heads=6, seq_length=128),
    "gpt2-124m": dict(
        num_layers=12, hidden_size=768, num_attention_heads=12, seq_length=1024, vocab_size=50257
    ),
    "gpt2-1.5b": dict(
        num_layers=48, hidden_size=1600, num_attention_heads=16, seq_length=1024, vocab_size=50257
    ),
    "gpt2-10b": dict(
        num_layers=50,
        hidden_size=4096,
        num_attention_heads=32,
        seq_length=1024,
        vocab_size=50257,
        checkpoint_activations=True,
    ),
}


@dataclass
class GPT2Config:
    """Model shape. ``seq_length`` is also the size of the position-embedding table."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int = 256
    ffn_hidden_size: int | None = None  # None means 4 * hidden_size
    dropout: float = 0.0
    checkpoint_activations: bool = False
    tie_word_embeddings: bool = True
    layernorm_epsilon: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "seq_length",
            "vocab_size",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPT2Config.{name} must be a positive integer, got {value!r}")
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        elif not isinstance(self.ffn_hidden_size, int) or self.ffn_hidden_size <= 0:
            raise ValueError(
                f"GPT2Config.ffn_hidden_size must be a positive integer or None, "
                f"got {self.ffn_hidden_size!r}"
            )
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"GPT2Config.hidden_size ({self.hidden_size}) must be divisible by "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPT2Config.dropout must be in [0, 1), got {self.dropout!r}")
        if not self.layernorm_epsilon > 0:
            raise ValueError(
                f"GPT2Config.layernorm_epsilon must be positive, got {self.layernorm_epsilon!r}"
            )
        if not self.init_std > 0:
            raise ValueError(f"GPT2Config.init_std must be positive, got {self.init_std!r}")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> GPT2Config:
        """A named size (see ``PRESETS``), with any field overridden by keyword."""
        if name not in PRESETS:
            raise ValueError(f"unknown GPT-2 preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class SelfAttention(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.dropout = config.dropout
        self.query_key_value = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        qkv = self.query_key_value(x).view(batch, seq, 3, self.num_heads, hidden // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (batch, heads, seq, head_dim)
        dropout_p = self.dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        return self.dense(out.transpose(1, 2).reshape(batch, seq, hidden))


class MLP(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        assert config.ffn_hidden_size is not None  # filled in by __post_init__
        self.dense_h_to_4h = nn.Linear(config.hidden_size, config.ffn_hidden_size)
        self.dense_4h_to_h = nn.Linear(config.ffn_hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x)))


class TransformerBlock(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.attention = SelfAttention(config)
        self.post_attention_layernorm = nn.LayerNorm(
            config.hidden_size, eps=config.layernorm_epsilon
        )
        self.mlp = MLP(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.input_layernorm(x)))
        return x + self.dropout(self.mlp(self.post_attention_layernorm(x)))


class GPT2Model(nn.Module):
    """``forward(input_ids, labels=None)``: mean cross-entropy with labels, else logits."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.config = config
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.seq_length, config.hidden_size)
        self.embedding_dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.num_layers))
        self.final_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            # The same Parameter object: parameters() yields it once, so every consumer
            # (flat buffers, optimizers, checkpoints) sees one tensor with both gradients summed.
            self.lm_head.weight = self.word_embeddings.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Megatron init: N(0, std) weights, zero biases, unit norms; the two projections that
        write into the residual stream use std / sqrt(2 * num_layers) so its variance stays
        independent of depth.

        Under ``zero.Init`` the submodules' params are already partitioned (empty) when this
        runs from ``__init__``: each module's own params are then gathered, set on rank 0 and
        re-partitioned, one module at a time, so building never holds more than one module's
        full params."""
        std = self.config.init_std
        output_std = std / math.sqrt(2.0 * self.config.num_layers)
        residual_out = {id(m) for layer in self.layers for m in _residual_outputs(layer)}
        for module in self.modules():
            own = list(module.parameters(recurse=False))
            if not own:
                continue
            with _writable(own), torch.no_grad():
                if isinstance(module, nn.Linear | nn.Embedding):
                    w_std = output_std if id(module) in residual_out else std
                    nn.init.normal_(module.weight, mean=0.0, std=w_std)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    nn.init.zeros_(module.bias)
                if isinstance(module, nn.LayerNorm):
                    nn.init.ones_(module.weight)
                    nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
        seq = input_ids.shape[1]
        if seq > self.config.seq_length:
            raise ValueError(
                f"input_ids has {seq} positions but GPT2Config.seq_length is "
                f"{self.config.seq_length}"
            )
        positions = torch.arange(seq, device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        x = self.embedding_dropout(x)
        recompute = self.config.checkpoint_activations and self.training
        for layer in self.layers:
            x = _recompute(layer, x) if recompute else layer(x)
        logits = self.lm_head(self.final_layernorm(x))
        if labels is None:
            return logits
        # fp32 softmax: a bf16/fp16 log-sum-exp over the vocabulary loses the small differences
        # that carry the gradient late in training.
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


def _residual_outputs(layer: nn.Module) -> tuple[nn.Module, ...]:
    """The projections of a block that write into the residual stream."""
    return (layer.attention.dense, layer.mlp.dense_4h_to_h)


def _writable(params: list[nn.Parameter]) -> contextlib.AbstractContextManager:
    """A context in which ``params`` hold their full values and writes to them stick: nothing
    for ordinary params; for params partitioned by ``zero_offload.zero.Init`` (or a stage-3
    engine), ``GatheredParameters`` with rank 0 as the modifier."""
    ours = []
    for p in params:
        if partitioned.is_partitioned(p):
            ours.append(p)
        elif hasattr(p, "ds_tensor"):  # partitioned, but not by this library
            raise RuntimeError(
                "GPT2Model.reset_parameters: params partitioned by another library's zero.Init "
                "cannot be initialized here; build the model under zero_offload.zero.Init, or "
                "without one"
            )
    if not ours:
        return contextlib.nullcontext()
    from ..zero.gathered import GatheredParameters

    return GatheredParameters(ours, modifier_rank=0)


def num_parameters(config: GPT2Config) -> int:
    """Parameter count in closed form, the tied embedding counted once."""
    h, f, v = config.hidden_size, config.ffn_hidden_size, config.vocab_size
    assert f is not None
    per_layer = (
        2 * h  # input layernorm
        + 3 * h * h
        + 3 * h  # fused qkv
        + h * h
        + h  # attention output
        + 2 * h  # post-attention layernorm
        + h * f
        + f  # h -> 4h
        + f * h
        + h  # 4h -> h
    )
    embeddings = v * h + config.seq_length * h
    lm_head = 0 if config.tie_word_embeddings else v * h
    return embeddings + config.num_layers * per_layer + 2 * h + lm_head


def flops_per_token(config: GPT2Config) -> float:
    """Model FLOPs per trained token (forward + backward), for model-TFLOPS reporting.

    6 FLOPs per matmul weight per token (2 forward, 4 backward), where the matmul weights are all
    parameters but the position table (a lookup; the tied token table is used as the LM head
    matmul), plus the attention scores and weighted sum: 6 * 2 * num_layers * seq * hidden
    (the usual PaLM-style count, not halved for the causal mask). Activation recomputation is
    not counted: this is model, not hardware, FLOPs.
    """
    matmul_params = num_parameters(config) - config.seq_length * config.hidden_size
    attention = 12.0 * config.num_layers * config.seq_length * config.hidden_size
    return 6.0 * matmul_params + attention


def param_groups(model: nn.Module, weight_decay: float | None = None) -> list[dict[str, Any]]:
    """Two optimizer groups: 2-D weights (matmuls and embeddings) decay, biases and norm weights
    do not. With ``weight_decay=None`` the decay group carries no ``weight_decay`` key, so the
    optimizer's configured value applies (the Megatron convention)."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for _, param in model.named_parameters():  # deduplicates the tied embedding
        if not param.requires_grad:
            continue
        (decay if param.dim() >= 2 else no_decay).append(param)
    decay_group: dict[str, Any] = {"params": decay}
    if weight_decay is not None:
        decay_group["weight_decay"] = float(weight_decay)
    groups = [decay_group, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]
