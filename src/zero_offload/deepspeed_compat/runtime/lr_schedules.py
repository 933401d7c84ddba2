"""``deepspeed.runtime.lr_schedules``: the schedules zero_offload implements (DeepSpeed's
classes, names and arguments). ``VALID_LR_SCHEDULES`` lists them; accelerate reads it to tell a
DeepSpeed schedule from a torch one."""

from ...schedulers import WarmupCosineLR, WarmupDecayLR, WarmupLR
from .._common import not_provided_getattr

VALID_LR_SCHEDULES = ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]

__all__ = ["VALID_LR_SCHEDULES", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]
__getattr__ = not_provided_getattr(
    __name__,
    {
        "LRRangeTest": " (use WarmupLR, WarmupDecayLR or WarmupCosineLR)",
        "OneCycle": " (use WarmupLR, WarmupDecayLR or WarmupCosineLR)",
    },
)
