"""The optional dependencies, imported on use with an error that says how to install them."""

from __future__ import annotations

import importlib
from types import ModuleType

_HINT = "install it with: pip install 'zero_offload[hf]' (or pip install {name})"


class MissingDependencyError(ImportError):
    """An optional package a feature needs is not installed."""


def _require(name: str, feature: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise MissingDependencyError(
            f"{feature} needs the '{name}' package, which is not installed; {_HINT.format(name=name)}"
        ) from exc


def require_transformers(feature: str = "Hugging Face models (--model)") -> ModuleType:
    return _require("transformers", feature)


def require_peft(feature: str = "LoRA (--lora)") -> ModuleType:
    return _require("peft", feature)
