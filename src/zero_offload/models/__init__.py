"""Models the project trains and benchmarks with."""

from zero_offload.models.gpt2 import (
    PRESETS,
    GPT2Config,
    GPT2Model,
    flops_per_token,
    num_parameters,
    param_groups,
)

__all__ = [
    "PRESETS",
    "GPT2Config",
    "GPT2Model",
    "flops_per_token",
    "num_parameters",
    "param_groups",
]
