"""``deepspeed.ops.adam``: ``DeepSpeedCPUAdam`` (this project's SIMD host kernel) and
``FusedAdam`` (torch's fused Adam(W)), DeepSpeed's signatures."""

from ....ops.adam import DeepSpeedCPUAdam, FusedAdam
from ..._common import not_provided_getattr

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
__getattr__ = not_provided_getattr(__name__)
