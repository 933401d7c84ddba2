"""Shared by the namespace's modules: the not-provided ``__getattr__``, the exceptions, and the
reading of the two settings the Hugging Face libraries write into every DeepSpeed config (and of
the file they read it from, for messages)."""

from __future__ import annotations

import math

from .._as_deepspeed import (  # noqa: F401
    DeepSpeedModuleNotProvidedError,
    DeepSpeedNotProvidedError,
    not_provided_getattr,
)
from ..config.loading.origin import NamedConfig, origin_of


def as_zero_offload_config(config):
    """A config dict as DeepSpeed reads it: ``steps_per_print`` infinite (accelerate's "never
    log") is no step log, and ``zero_allow_untested_optimizer: true`` (the Trainer sets it for
    its own optimizers; every client optimizer is allowed here) is dropped. Anything else, a
    path included, is returned as is."""
    if not isinstance(config, dict):
        return config
    origin = origin_of(config)  # the file Hugging Face's reader read it from
    config = dict(config) if origin is None else NamedConfig(config, origin)
    spp = config.get("steps_per_print")
    if isinstance(spp, float) and math.isinf(spp) and spp > 0:
        del config["steps_per_print"]
    if config.get("zero_allow_untested_optimizer") is True:
        del config["zero_allow_untested_optimizer"]
    return config
