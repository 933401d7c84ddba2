"""DeepSpeed's ``deepspeed.ops`` names: ``zero_offload.ops.adam.DeepSpeedCPUAdam`` and ``FusedAdam``."""

from . import adam

__all__ = ["adam"]
