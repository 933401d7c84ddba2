"""The process-wide state of the checkpointing API, as DeepSpeed keeps it: the policy that
``configure`` set (defaults until then), whether it was called, and the model-parallel unit;
also whether the policy came from the script (``configure``) or from an engine's config."""

from __future__ import annotations

import logging
from typing import Any

from .policy import CheckpointPolicy

log = logging.getLogger("zero_offload")


class Settings:
    def __init__(self) -> None:
        self.policy = CheckpointPolicy()
        self.configured = False
        self.by_script = False  # configure() was called: an engine's section does not replace it
        self.mpu: Any = None

    def model_parallel(self) -> tuple[int, int]:
        """(rank, world size) of this rank's tensor-model-parallel group; (0, 1) without one."""
        mpu = self.mpu
        if mpu is None:
            return 0, 1
        if hasattr(mpu, "get_tensor_model_parallel_rank"):
            return mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()
        return mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size()

    def apply(self, policy: CheckpointPolicy, mpu: Any = None) -> None:
        policy.check()
        if mpu is not None:
            self.mpu = mpu
        self.policy = policy
        self.configured = True
        _, mp_size = self.model_parallel()
        if policy.partition_activations:
            log.info(
                "activation_checkpointing.partition_activations: no effect%s",
                " (one model-parallel rank: the partition is the whole input)"
                if mp_size == 1
                else f" (not built: each of the {mp_size} model-parallel ranks keeps the "
                "whole input)",
            )
        if policy.contiguous_memory_optimization:
            log.info(
                "activation_checkpointing.contiguous_memory_optimization: no effect (each "
                "checkpoint's inputs are allocated on their own)"
            )


SETTINGS = Settings()
