"""The DeepSpeed features DeepSpeed 0.19.8 removed and refuses by key: a config that still names
one fails here with DeepSpeed's own words (``deepspeed/runtime/config.py``), since accepting it
would train as if the feature were off while the config says it is on. As in DeepSpeed, the key's
presence is enough, whatever its value."""

from __future__ import annotations

from typing import Any

_ISSUE = "https://github.com/deepspeedai/DeepSpeed/issues/8489"

REMOVED_TOP_LEVEL: dict[str, str] = {
    "nebula": "Nebula checkpointing has been removed. A leftover 'nebula' block would be ignored "
    f"and checkpoints would silently fall back to local torch.save. See {_ISSUE}.",
    "compression_training": "The DeepSpeed compression library has been removed. A leftover "
    "'compression_training' block would be ignored and the model would train unquantized. "
    f"See {_ISSUE}.",
    "amp": "NVIDIA Apex AMP integration has been removed. Use DeepSpeed 'fp16', 'bf16', or "
    f"'torch_autocast' instead. See {_ISSUE}.",
    "quantize_training": "Mixture-of-Quantization (MoQ) / 'quantize_training' has been removed. "
    f"See {_ISSUE}.",
    "sparse_gradients": "Sparse compression of dense torch.nn.Embedding gradients has been "
    "removed. A leftover 'sparse_gradients' flag would be ignored and those gradients would be "
    "reduced dense. Gradients from an embedding constructed with sparse=True are still reduced "
    f"sparsely and need no config flag. See {_ISSUE}.",
    "eigenvalue": "Eigenvalue-based Mixture-of-Quantization (MoQ) has been removed; the "
    f"standalone 'eigenvalue' configuration block is no longer supported. See {_ISSUE}.",
    "sparse_attention": "DeepSpeed Sparse Attention has been removed; the 'sparse_attention' "
    f"configuration block is no longer supported. See {_ISSUE}.",
    "elasticity": "Elastic training has been removed; the 'elasticity' configuration block is no "
    "longer supported. Set train_batch_size / train_micro_batch_size_per_gpu / "
    "gradient_accumulation_steps directly.",
    "graph_harvesting": "Graph harvesting has been removed; the 'graph_harvesting' configuration "
    f"option is no longer supported. See {_ISSUE}.",
    "curriculum_learning": "Legacy top-level 'curriculum_learning' has been removed. Use "
    f"'data_efficiency.data_sampling.curriculum_learning' instead. See {_ISSUE}.",
    "progressive_layer_drop": "Progressive Layer Dropping has been removed; the "
    f"'progressive_layer_drop' configuration block is no longer supported. See {_ISSUE}.",
}

REMOVED_ZERO: dict[str, str] = {
    "mics_shard_size": "MiCS ZeRO-3 sharding has been removed; 'zero_optimization.mics_shard_size' "
    f"is no longer supported. See {_ISSUE}.",
    "mics_hierarchical_params_gather": "MiCS ZeRO-3 sharding has been removed; "
    "'zero_optimization.mics_hierarchical_params_gather' is no longer supported. "
    f"See {_ISSUE}.",
    "zeropp_loco_param": "LoCo-Zero++ has been removed; 'zero_optimization.zeropp_loco_param' is "
    "no longer supported. Remove this key to use standard ZeRO++ quantized gradients without "
    f"LoCo error feedback. See {_ISSUE}.",
}

# The removed optimizers: DeepSpeed 0.19.8 no longer builds them (its engine then looks the
# name up in torch.optim and fails); refused here at load with the key.
REMOVED_OPTIMIZERS: dict[str, str] = {
    "OneBitAdam": "1-bit Adam",
    "ZeroOneAdam": "0/1 Adam",
    "OneBitLamb": "1-bit LAMB",
}
_REMOVED_BY_LOWER = {name.lower(): what for name, what in REMOVED_OPTIMIZERS.items()}


def removed_problems(raw: dict[str, Any]) -> list[str]:
    """One line per removed key present in ``raw`` (DeepSpeed's message, after the key)."""
    lines = [f"{key}: {message}" for key, message in REMOVED_TOP_LEVEL.items() if key in raw]
    zero = raw.get("zero_optimization")
    if isinstance(zero, dict):
        lines.extend(
            f"zero_optimization.{key}: {message}"
            for key, message in REMOVED_ZERO.items()
            if key in zero
        )
    optimizer = raw.get("optimizer")
    kind = optimizer.get("type") if isinstance(optimizer, dict) else None
    if isinstance(kind, str) and kind.lower() in _REMOVED_BY_LOWER:
        lines.append(
            f'optimizer.type: "{kind}": DeepSpeed\'s {_REMOVED_BY_LOWER[kind.lower()]} '
            'has been removed (DeepSpeed 0.19.8 no longer builds it); use "Adam" or "AdamW"'
        )
    return lines


def without_removed(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` without the removed keys (each already reported), so no other check repeats them."""
    out = {k: v for k, v in raw.items() if k not in REMOVED_TOP_LEVEL}
    zero = out.get("zero_optimization")
    if isinstance(zero, dict):
        out["zero_optimization"] = {k: v for k, v in zero.items() if k not in REMOVED_ZERO}
    return out
