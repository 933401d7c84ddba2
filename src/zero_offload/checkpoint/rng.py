"""Per-rank random number generator states: python ``random``, numpy's global generator (when
numpy is importable), torch's CPU generator and the CUDA generator of the engine's device.

The tensor states (torch CPU, CUDA) go into the rank's safetensors file; python's and numpy's are
integer lists and go into its JSON metadata. Restoring them makes dropout masks and data order
after a resume the same as in an uninterrupted run.
"""

from __future__ import annotations

import random

import torch

from .format import RNG_CUDA, RNG_TORCH


def capture(device: torch.device) -> tuple[dict, dict[str, torch.Tensor]]:
    """(JSON part, tensor part) of this process's RNG states."""
    version, internal, gauss = random.getstate()
    state: dict = {"python": [version, list(internal), gauss]}
    try:
        import numpy as np
    except ImportError:
        np = None
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state["numpy"] = [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]
    tensors = {RNG_TORCH: torch.get_rng_state()}
    if device.type == "cuda":
        tensors[RNG_CUDA] = torch.cuda.get_rng_state(device)
    return state, tensors


def restore(state: dict, tensors: dict[str, torch.Tensor], device: torch.device) -> None:
    """Set every generator captured in ``state``/``tensors``; ones not captured are left alone."""
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((int(version), tuple(int(x) for x in internal), gauss))
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:
            np = None
        if np is not None:
            kind, keys, pos, has_gauss, cached = state["numpy"]
            np.random.set_state(
                (kind, np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached))
            )
    if RNG_TORCH in tensors:
        torch.set_rng_state(tensors[RNG_TORCH].to(torch.uint8))
    if RNG_CUDA in tensors and device.type == "cuda":
        torch.cuda.set_rng_state(tensors[RNG_CUDA].to(torch.uint8), device)
