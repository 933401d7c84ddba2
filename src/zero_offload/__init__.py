"""zero_offload: ZeRO stages 1-3 data parallelism with optimizer (and, at stage 3, parameter)
offload to the host, a SIMD CPU Adam, configured with DeepSpeed's JSON keys
(``import zero_offload as deepspeed`` mostly just works)."""

from .api import add_config_arguments, initialize
from .checkpoint import get_fp32_state_dict_from_zero_checkpoint
from .runtime.dist import init_distributed
from .runtime.engine import ZeroOffloadEngine

DeepSpeedEngine = ZeroOffloadEngine
__version__ = "0.1.0"

__all__ = [
    "DeepSpeedEngine",
    "ZeroOffloadEngine",
    "__version__",
    "comm",
    "ops",
    "utils",
    "zero",
    "add_config_arguments",
    "get_fp32_state_dict_from_zero_checkpoint",
    "init_distributed",
    "initialize",
]


def __getattr__(name: str):
    # DeepSpeed's subpackage names (deepspeed.comm, .ops, .utils, .zero), imported on first use
    # so ``import zero_offload`` loads no more than the engine needs.
    if name in ("comm", "ops", "utils", "zero"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
