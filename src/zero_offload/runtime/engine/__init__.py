"""The engine: assembly from the config, the training loop's calls, DeepSpeed's accessors."""

from .engine import ZeroOffloadEngine

__all__ = ["ZeroOffloadEngine"]
