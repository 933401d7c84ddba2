"""The run folder's model export: a ``save_pretrained`` folder ``from_pretrained`` loads."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..runtime.status import require_whole


def export_pretrained(hf_model: torch.nn.Module, out_dir: str | os.PathLike[str]) -> list[str]:
    """Write ``hf_model`` with ``save_pretrained`` (safetensors) as trained: weights in the
    training dtype, as DeepSpeed's ``save_16bit_model`` does. A peft model is written twice:
    its adapter alone to ``<out_dir>_adapter`` (``PeftModel.from_pretrained``), then merged into
    the base weights to ``out_dir`` (``AutoModelForCausalLM.from_pretrained``); merging changes
    ``hf_model`` in place, so call this last. Returns the folders written.

    At ZeRO stage 3 every rank must call it inside ``with engine.params_on_host():`` (rank 0
    writes); a partitioned param outside that raises rather than being written empty."""
    require_whole(hf_model, f"export to {out_dir}")
    out = Path(out_dir)
    written = []
    if hasattr(hf_model, "merge_and_unload"):  # a peft model
        adapter = out.with_name(out.name + "_adapter")
        hf_model.save_pretrained(str(adapter))
        written.append(str(adapter))
        hf_model = hf_model.merge_and_unload()
    hf_model.save_pretrained(str(out), safe_serialization=True)
    written.append(str(out))
    return written
