"""``deepspeed.runtime.engine``: ``DeepSpeedEngine`` is zero_offload's engine (isinstance checks
of transformers, accelerate and TRL hold for it)."""

from ...runtime.engine.engine import ZeroOffloadEngine as DeepSpeedEngine
from .._common import not_provided_getattr

__all__ = ["DeepSpeedEngine"]
__getattr__ = not_provided_getattr(__name__)
