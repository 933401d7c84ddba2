"""``torch_autocast`` section: DeepSpeed's native-autocast mode. The model's params keep their
dtype (fp32) and the engine runs each forward under ``torch.autocast`` in ``dtype``; the
params of the ``lower_precision_safe_modules`` classes are marked with that dtype as their
communication dtype (``param.comm_dtype``, as DeepSpeed marks them)."""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field, field_validator

from ..errors import json_repr
from ..fields import Bool, Section, Str

# DeepSpeed's spellings of the two autocast dtypes (its DtypeEnum's names).
AUTOCAST_DTYPES: dict[str, torch.dtype] = {
    **dict.fromkeys(("torch.float16", "fp16", "float16", "half"), torch.float16),
    **dict.fromkeys(("torch.bfloat16", "bf16", "bfloat16", "bfloat"), torch.bfloat16),
}


class TorchAutocastConfig(Section):
    """Forward passes under ``torch.autocast``; fp16 adds dynamic loss scaling with torch's
    ``GradScaler`` defaults, as DeepSpeed adds a ``GradScaler``."""

    enabled: Bool = Field(
        False,
        description="Run the engine's forward under torch.autocast (params stay in their dtype).",
    )
    dtype: Str | None = Field(
        None,
        description='The autocast dtype: "torch.bfloat16" / "bf16" / "bfloat16" or '
        '"torch.float16" / "fp16" / "float16" / "half"; fp16 scales the loss dynamically as '
        "torch's GradScaler does (from 2**16, halved on each overflow, doubled after 2000 clean "
        "steps). Null: torch's default for the device.",
    )
    lower_precision_safe_modules: list[Str] | None = Field(
        None,
        description="Module classes (fully qualified names) whose params are marked with the "
        "autocast dtype as their communication dtype. Null: torch.nn.Linear and Conv1d/2d/3d.",
    )

    @field_validator("dtype", mode="after")
    @classmethod
    def _dtype(cls, value: Any) -> Any:
        if value is not None and value not in AUTOCAST_DTYPES:
            allowed = ", ".join(json_repr(name) for name in AUTOCAST_DTYPES)
            raise ValueError(f"allowed: {allowed}; got {json_repr(value)}")
        return value

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The autocast dtype, None for torch's default of the device."""
        return AUTOCAST_DTYPES[self.dtype] if self.dtype is not None else None
