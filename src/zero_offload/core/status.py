"""DeepSpeed's per-param gather status (``p.ds_status``) for partitioned (stage 3) params."""

from __future__ import annotations

import enum

import torch


class ZeroParamStatus(enum.Enum):
    AVAILABLE = 1  # full data bound to the param
    NOT_AVAILABLE = 2  # only this rank's shard exists; p.numel() == 0
    INFLIGHT = 3  # an all-gather is under way


class PartitionedParamError(RuntimeError):
    """A whole-model read (export, state dict) met a param that holds only its shard."""


def require_whole(module: torch.nn.Module, what: str) -> None:
    """Raise unless every param of ``module`` holds its full value: a stage-3 param outside a
    gather has ``numel() == 0`` and would be written as an empty tensor, silently."""
    empty = [
        n
        for n, p in module.named_parameters(remove_duplicate=False)
        if hasattr(p, "ds_numel") and p.numel() != p.ds_numel
    ]
    if empty:
        shown = ", ".join(empty[:3]) + (f" and {len(empty) - 3} more" if len(empty) > 3 else "")
        raise PartitionedParamError(
            f"{what}: {len(empty)} param(s) are partitioned (ZeRO stage 3) and hold no data here: "
            f"{shown}. Read them inside `with engine.params_on_host():` (every rank) or "
            "zero.GatheredParameters(model.parameters()), or use engine.save_16bit_model"
        )
