"""Shared by the namespace's modules: the not-provided ``__getattr__``, the exceptions, and the
reading of the two settings the Hugging Face libraries write into every DeepSpeed config."""

from __future__ import annotations

import math

from .._as_deepspeed import (  # noqa: F401
    DeepSpeedModuleNotProvidedError,
    DeepSpeedNotProvidedError,
    not_provided_getattr,
)


def as_zero_offload_config(config):
    """A config dict as DeepSpeed reads it: ``steps_per_print`` infinite (accelerate's "never
    log") is no step log, and ``zero_allow_untested_optimizer: true`` (the Trainer sets it for
    its own optimizers; every client optimizer is allowed here) is dropped. Anything else, a
    path included, is returned as is."""
    if not isinstance(config, dict):
        return config
    config = dict(config)
    spp = config.get("steps_per_print")
    if isinstance(spp, float) and math.isinf(spp) and spp > 0:
        del config["steps_per_print"]
    if config.get("zero_allow_untested_optimizer") is True:
        del config["zero_allow_untested_optimizer"]
    return config
