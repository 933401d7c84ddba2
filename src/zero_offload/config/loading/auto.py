"""``"auto"`` values: Hugging Face's "fill this in from the training arguments".

The loader drops an ``"auto"`` key and validation gives it the default. Some keys are then
filled by something real: the batch triple by its arithmetic (any two imply the third, and a
launcher's ``--batch-size`` gives the micro batch), and the stage-3 sizes below by the engine
from the model's ``config.hidden_size`` (Hugging Face's rule). Every other ``"auto"`` has nothing
to fill it here: :func:`auto_report` lists each such key with the default chosen, for one
warning, so a silent ``"lr": "auto" -> 1e-3`` cannot happen.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..errors import json_repr

# Resolved by the engine from the model (reduce_bucket_size = hidden**2, prefetch =
# 0.9 * hidden**2, persistence threshold = 10 * hidden): no default is claimed for them here.
ENGINE_RESOLVED = frozenset(
    {
        "zero_optimization.reduce_bucket_size",
        "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.stage3_param_persistence_threshold",
        "zero_optimization.prefetch_bucket_size",
        "zero_optimization.param_persistence_threshold",
    }
)
_BATCH = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


class AutoValueWarning(UserWarning):
    """An ``"auto"`` config value that nothing could fill; the default was used."""


def _lookup(data: dict[str, Any], path: str) -> tuple[bool, Any]:
    node: Any = data
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def auto_report(auto: Iterable[str], ignored: Iterable[str], resolved: dict[str, Any]) -> list[str]:
    """``key=value`` for every ``"auto"`` key that got a default rather than a filled value.

    ``resolved`` is the validated config as JSON. Batch keys are always filled by the batch
    rule (any two imply the third; one alone with gradient_accumulation_steps 1, DeepSpeed's
    rule), a launcher's ``--batch-size`` supplying the micro batch.
    """
    skipped = set(ignored)
    out = []
    for path in sorted(auto):
        if path in ENGINE_RESOLVED or path in skipped:
            continue
        if path in _BATCH:
            continue
        found, value = _lookup(resolved, path)
        if found:
            out.append(f"{path}={json_repr(value)}")
    return out
