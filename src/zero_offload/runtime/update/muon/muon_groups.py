"""Muon's param groups, as DeepSpeed's engine builds them: every param must say ``use_muon``;
the trainable ones with ``use_muon`` true form the Muon group, the others the AdamW aux group.

``deepspeed.initialize`` first marks every param of the model that lacks the flag by DeepSpeed's
rule (``default_flags``: 2-d or more and no "embed" / "lm_head" in its name), so the error below
is reached through ``zero_offload.initialize`` or with params outside the model.
"""

from __future__ import annotations

import torch

MISSING_FLAG = (
    "Muon optimizer is used, but the use_muon attribute is NOT configured for some of the "
    "model parameters, please set by `param.use_muon = True / False` for all params"
)


def default_flags(model: torch.nn.Module) -> None:
    """DeepSpeed's ``set_optimizer_flags`` for the params that do not carry ``use_muon`` yet
    (DeepSpeed overwrites every param's flag; a flag the user set is kept here)."""
    for name, p in model.named_parameters():
        if not hasattr(p, "use_muon"):
            lowered = name.lower()
            p.use_muon = p.ndim >= 2 and "embed" not in lowered and "lm_head" not in lowered


def muon_param_groups(params: list, muon_hyper: dict, aux_hyper: dict) -> list[dict]:
    """``params``: tensors, or param-group dicts (their params are taken, their other keys
    dropped, as DeepSpeed flattens them); ``muon_hyper`` / ``aux_hyper``: each group's
    hyperparameters (``MuonParams.muon_group()`` / ``aux_group()``). The Muon group first, then
    the aux group; a group with no trainable param is left out."""
    flat: list[torch.Tensor] = []
    for item in params:
        flat.extend(_params_of(item) if isinstance(item, dict) else [item])
    missing = [p for p in flat if not hasattr(p, "use_muon")]
    if missing:
        raise ValueError(f"{MISSING_FLAG} ({len(missing)} of {len(flat)} params lack it)")
    muon = [p for p in flat if p.use_muon and p.requires_grad]
    aux = [p for p in flat if not p.use_muon and p.requires_grad]
    for p in muon:
        if p.ndim < 2:
            raise ValueError(
                f"use_muon is true for a param of shape {list(p.shape)}: Muon orthogonalizes "
                "matrices (2-d or more); set use_muon = False for it (the aux AdamW group)"
            )
    groups = []
    if muon:
        groups.append({**muon_hyper, "params": muon})
    if aux:
        groups.append({**aux_hyper, "params": aux})
    return groups


def _params_of(group: dict) -> list[torch.Tensor]:
    p = group["params"]
    return [p] if isinstance(p, torch.Tensor) else list(p)
