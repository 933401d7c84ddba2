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
from ....activation_checkpointing.settings import SETTINGS
from ..._common import not_provided_getattr

# DeepSpeed's module globals that scripts read, answered from the current settings (read-only:
# assigning one changes nothing; configure() does).
_GLOBALS = {
    "PARTITION_ACTIVATIONS": lambda: SETTINGS.policy.partition_activations,
    "CPU_CHECKPOINT": lambda: SETTINGS.policy.cpu_checkpointing,
    "CONTIGUOUS_CHECKPOINTING": lambda: SETTINGS.policy.contiguous_memory_optimization,
    "SYNCHRONIZE": lambda: SETTINGS.policy.synchronize,
    "PROFILE_TIME": lambda: SETTINGS.policy.profile,
    "num_layers": lambda: SETTINGS.policy.number_checkpoints,
    "mpu": lambda: SETTINGS.mpu,
    "deepspeed_checkpointing_enabled": lambda: SETTINGS.configured,
}
_not_provided = not_provided_getattr(__name__)


def __getattr__(name: str):
    if name in _GLOBALS:
        return _GLOBALS[name]()
    return _not_provided(name)
