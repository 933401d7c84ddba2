"""``DeepSpeedCPUAdam`` (the host SIMD Adam as a standalone torch optimizer) and ``FusedAdam``
(torch's fused/foreach Adam(W) under DeepSpeed's name and signature)."""

from .cpu_adam import DeepSpeedCPUAdam
from .fused_adam import FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
