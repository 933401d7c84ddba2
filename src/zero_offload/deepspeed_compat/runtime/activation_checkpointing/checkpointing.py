"""``deepspeed.checkpointing`` (``deepspeed.runtime.activation_checkpointing.checkpointing``):
zero_offload's activation checkpointing (``zero_offload.activation_checkpointing``) under
DeepSpeed's names. ``partition_activations`` and ``contiguous_checkpointing`` are accepted and
change nothing (one model-parallel rank); ``checkpoint_in_cpu`` keeps the inputs in host memory."""

from ....activation_checkpointing import (  # noqa: F401
    CheckpointFunction,
    checkpoint,
    configure,
    get_cuda_rng_tracker,
    is_configured,
    model_parallel_cuda_manual_seed,
    non_reentrant_checkpoint,
    partition_activations_in_checkpoint,
    reset,
    set_num_layers,
)
from ....activation_checkpointing import RngStatesTracker as CudaRNGStatesTracker  # noqa: F401
from ..._common import not_provided_getattr

__getattr__ = not_provided_getattr(__name__)
