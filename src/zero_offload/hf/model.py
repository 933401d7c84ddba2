"""Loading a local Hugging Face causal LM and giving it the main job's forward contract."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F

from .deps import require_transformers
from .weight_files import WeightFiles, find_weights


class CausalLMLoss(torch.nn.Module):
    """``forward(input_ids, labels) -> mean cross-entropy``, the contract of the main job's
    models. ``labels`` are already shifted (``labels[t] == input_ids[t + 1]``, as
    TokenBlockDataset makes them), so the loss is computed here from the logits rather than by
    the model's own ``labels=`` path, which would shift a second time."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=input_ids, use_cache=False).logits
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1))


def load_causal_lm(
    path: str | os.PathLike[str],
    dtype: torch.dtype = torch.float32,
    zero3_config: dict | None = None,
) -> torch.nn.Module:
    """A local Hugging Face causal LM folder (config.json and safetensors, as
    ``save_pretrained`` writes them), loaded as this rank will hold it:

    - ``zero3_config`` None (stages 0-2): ``from_pretrained`` in the training ``dtype``; the
      engine keeps the model in that dtype anyway, so no rank holds an fp32 copy of a 16-bit
      model (buffers keep their own dtype, as the engine keeps them);
    - ``zero3_config`` given (stage 3): the model is built under ``zero.Init`` with that config,
      each module partitioned as it is constructed, then each rank reads only its own chunks of
      the weights from the memory-mapped files (``partitioned_load``): ``from_pretrained``'s
      model, or a ``WeightFileError`` naming the tensor and the file.

    Every weight file is opened first: a truncated or damaged one is an error naming it."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"--model {path}: not a Hugging Face model folder (no config.json); give the folder "
            "save_pretrained wrote"
        )
    transformers = require_transformers()
    try:
        found = find_weights(folder)  # every weight file opens whole, or an error names it
        if zero3_config is None:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                str(folder), local_files_only=True, dtype=dtype
            )
        else:
            model = _load_partitioned(transformers, found, dtype, zero3_config)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--model {path}: cannot load a causal LM: {exc}") from None
    model.config.use_cache = False
    return model


def _load_partitioned(transformers, found: WeightFiles, dtype: torch.dtype, ds_config: dict):
    from ..zero import Init
    from .partitioned_load import stream_into
    from .tied import untie_stored_apart

    config = transformers.AutoConfig.from_pretrained(str(found.folder), local_files_only=True)
    untie_stored_apart(transformers, config, found)  # from_pretrained's model, built untied
    with Init(config_dict_or_path=ds_config, dtype=dtype):
        model = transformers.AutoModelForCausalLM.from_config(config)
    stream_into(model, found)
    return model
