"""The checkpointing policy: DeepSpeed's ``activation_checkpointing`` settings as one typed
value, built from the config section or from ``configure``'s keyword arguments."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config.activation_checkpointing import ActivationCheckpointingConfig


@dataclass(frozen=True)
class CheckpointPolicy:
    """What ``checkpoint`` does with the inputs it keeps for the recompute.

    ``cpu_checkpointing``: the inputs wait in host memory, not on the device.
    ``partition_activations`` and ``contiguous_memory_optimization``: DeepSpeed's model-parallel
    split and its buffer layout; with one model-parallel rank (the only case here) they change
    nothing, and are recorded so that ``configure`` can say so. ``synchronize``: the device is
    synchronized at each checkpoint's boundaries. ``profile``: each checkpoint's forward and
    backward are timed and logged."""

    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    synchronize: bool = False
    profile: bool = False

    @classmethod
    def from_section(cls, section: ActivationCheckpointingConfig) -> CheckpointPolicy:
        """From a validated ``activation_checkpointing`` config section."""
        return cls(
            partition_activations=section.partition_activations,
            cpu_checkpointing=section.cpu_checkpointing,
            contiguous_memory_optimization=section.contiguous_memory_optimization,
            number_checkpoints=section.number_checkpoints,
            synchronize=section.synchronize_checkpoint_boundary,
            profile=section.profile,
        )

    def check(self) -> None:
        """DeepSpeed's two rules of ``configure`` (assertions there), naming the settings."""
        if self.contiguous_memory_optimization and not self.partition_activations:
            raise ValueError(
                "activation_checkpointing.contiguous_memory_optimization (contiguous_"
                "checkpointing) needs partition_activations true"
            )
        if self.contiguous_memory_optimization and self.number_checkpoints is None:
            raise ValueError(
                "activation_checkpointing.number_checkpoints (num_checkpoints) must be given "
                "with contiguous_memory_optimization"
            )
