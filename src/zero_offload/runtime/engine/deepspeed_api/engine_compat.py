"""DeepSpeed engine methods the Hugging Face libraries call, as a mixin of the engine.

transformers' ``Trainer`` and accelerate use a few more of DeepSpeed's engine names than a
training loop does: ``zero_gather_16bit_weights_on_model_save()`` and
``_zero3_consolidated_16bit_state_dict()`` (``Trainer.save_model`` /
``Accelerator.get_state_dict`` at stage 3), ``zero_optimization_partition_weights()``,
``engine.config.get(...)`` (DeepSpeed's ``engine.config`` is the config dict) and
``optimizer.overflow`` (accelerate's ``step_was_skipped``). Each is DeepSpeed's name and meaning
over state the engine already has.
"""

from __future__ import annotations

import torch


class DeepSpeedCompatAPI:
    """Mixed into ZeroOffloadEngine; uses its ``config``, ``stage``, counters and param store."""

    def zero_optimization_partition_weights(self) -> bool:
        """ZeRO stage 3: the 16-bit params are partitioned."""
        return self.stage == 3

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """``zero_optimization.stage3_gather_16bit_weights_on_model_save``: whether a stage-3
        model save may gather the whole model (``save_16bit_model``, ``Trainer.save_model``)."""
        return bool(self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save)

    def _zero3_consolidated_16bit_state_dict(
        self, exclude_frozen_parameters: bool = False
    ) -> dict[str, torch.Tensor] | None:
        """DeepSpeed's: the module's whole state dict (params in the training dtype, persistent
        buffers) on the CPU on rank 0, None on the other ranks. Every tensor has its own storage
        (a tied param is one tensor under each of its names). A collective: every rank calls
        it. Stage 3 only (below it ``module.state_dict()`` is whole already)."""
        if not self.zero_optimization_partition_weights():
            raise ValueError("this function requires ZeRO-3 mode")
        from ....checkpoint.export.sharded import consolidated_state_dict

        self.flush_delayed_update()
        # Streamed: the other ranks hold one gathered slot at a time, never the whole model.
        return consolidated_state_dict(self, exclude_frozen_parameters)

    @property
    def scales_loss(self) -> bool:
        """Whether a plain ``loss.backward()`` needs ``engine.scale(loss)``: fp16, or fp16
        autocast scaling the loss as torch's GradScaler does (``optimizer.needs_scaler()``)."""
        return self._fp16

    def last_step_overflowed(self) -> bool:
        """Whether the latest ``step()`` was an accumulation boundary whose update was skipped
        for inf/NaN gradients (``optimizer.overflow``)."""
        counts = self._before_step_counts
        if counts is None:
            return False
        steps, skipped = counts
        return self.global_steps > steps and self.skipped_steps > skipped
