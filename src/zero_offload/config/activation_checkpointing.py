"""``activation_checkpointing`` section: DeepSpeed's settings of its activation checkpointing API
(``deepspeed.checkpointing``, here ``zero_offload.activation_checkpointing``), which the engine
applies at ``initialize`` unless the script configured the API itself."""

from __future__ import annotations

from pydantic import Field, model_validator

from .fields import Bool, Int, Section, rule_error


class ActivationCheckpointingConfig(Section):
    """What ``checkpoint(function, *args)`` does with the inputs it keeps for the recompute."""

    partition_activations: Bool = Field(
        False,
        description="DeepSpeed: split each checkpointed input across the model-parallel ranks. "
        "This project has no model parallelism (one model-parallel rank), where DeepSpeed's "
        "split keeps the whole input: accepted and logged as a no-op.",
    )
    cpu_checkpointing: Bool = Field(
        False,
        description="Keep each checkpointed input in host memory (pinned, copied without "
        "blocking the host with CUDA) and bring it back to the device for its recompute, so the "
        "device holds one layer's input and activations at a time. On the CPU the host copy is "
        "the input itself.",
    )
    contiguous_memory_optimization: Bool = Field(
        False,
        description="DeepSpeed: copy partitioned inputs into one preallocated buffer per "
        "input position (needs partition_activations and number_checkpoints). Against "
        "fragmentation only; accepted and logged as a no-op.",
    )
    number_checkpoints: Int | None = Field(
        None,
        gt=0,
        description="Checkpoints per forward, sizing contiguous_memory_optimization's buffers. "
        "Null: not given.",
    )
    synchronize_checkpoint_boundary: Bool = Field(
        False,
        description="Synchronize the device at the start and end of each checkpoint's forward "
        "and backward (a debugging aid).",
    )
    profile: Bool = Field(
        False,
        description="Log each checkpoint's forward and backward time (rank 0; the device is "
        "synchronized around each).",
    )

    @model_validator(mode="after")
    def _rules(self) -> ActivationCheckpointingConfig:
        if self.contiguous_memory_optimization and not self.partition_activations:
            raise rule_error(
                "contiguous_memory_optimization",
                "true needs partition_activations true (DeepSpeed's rule: it is a layout of "
                "the partitions); set partition_activations true or this false",
            )
        if self.contiguous_memory_optimization and self.number_checkpoints is None:
            raise rule_error(
                "number_checkpoints",
                "null with contiguous_memory_optimization true: give the number of checkpoints "
                "per forward (an integer > 0)",
            )
        return self
