"""Activation checkpointing with DeepSpeed's API (``deepspeed.checkpointing`` in the namespace):
``configure``, ``is_configured``, ``reset``, ``checkpoint`` (reentrant), ``non_reentrant_
checkpoint``, ``get_cuda_rng_tracker``, ``model_parallel_cuda_manual_seed``.

The settings are process-wide, as DeepSpeed's are: ``configure`` (or the engine at
``initialize``, from the config's ``activation_checkpointing`` section, when the script did not
configure first) sets the :class:`CheckpointPolicy` every later ``checkpoint`` call follows."""

from __future__ import annotations

from .api import (  # noqa: F401
    configure,
    configure_from_engine,
    is_configured,
    model_parallel_cuda_manual_seed,
    partition_activations_in_checkpoint,
    policy,
    policy_of_config,
    reset,
    set_num_layers,
)
from .memory import COUNTERS, CheckpointBytes  # noqa: F401
from .non_reentrant import non_reentrant_checkpoint  # noqa: F401
from .policy import CheckpointPolicy  # noqa: F401
from .reentrant import CheckpointFunction, checkpoint  # noqa: F401
from .rng import MODEL_PARALLEL_RNG, RngStatesTracker, get_cuda_rng_tracker  # noqa: F401
from .settings import SETTINGS  # noqa: F401
