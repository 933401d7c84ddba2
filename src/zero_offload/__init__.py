"""zero_offload: ZeRO stages 1-3 data parallelism with optimizer (and, at stage 3, parameter)
offload to the host, a SIMD CPU Adam, configured with DeepSpeed's JSON keys
(``import zero_offload as deepspeed`` mostly just works).

Importing the package is cheap (no torch): every public name is loaded on first use, so the
interpreter-start hook of the DeepSpeed opt-in (``ZERO_OFFLOAD_AS_DEEPSPEED=1``, see
``zero_offload.as_deepspeed``) costs nothing until ``import deepspeed`` happens.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> (module relative to this package, attribute in it; None: the module itself)
_LAZY = {
    "add_config_arguments": (".api", "add_config_arguments"),
    "initialize": (".api", "initialize"),
    "get_fp32_state_dict_from_zero_checkpoint": (
        ".checkpoint",
        "get_fp32_state_dict_from_zero_checkpoint",
    ),
    "init_distributed": (".core.dist", "init_distributed"),
    "ZeroOffloadEngine": (".runtime.engine", "ZeroOffloadEngine"),
    "DeepSpeedEngine": (".runtime.engine", "ZeroOffloadEngine"),
    "as_deepspeed": ("._as_deepspeed", "as_deepspeed"),
    # DeepSpeed's subpackage names (deepspeed.comm, .ops, .utils, .zero)
    "comm": (".comm", None),
    "ops": (".ops", None),
    "utils": (".utils", None),
    "zero": (".zero", None),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    try:
        module_name, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    module = importlib.import_module(module_name, __name__)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
