"""DeepSpeed's engine accessors and accumulation controls, as a mixin of the engine.

Each method is DeepSpeed's name, signature and meaning (``deepspeed/runtime/engine.py``) over
state the engine already has. The accumulation controls (``set_gradient_accumulation_boundary``,
``no_sync``, ``set_train_batch_size``) set the engine's accumulation window (``window.py``),
whose rules decide which backward starts and which one ends a window.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Iterator

import torch

from ...precision.autocast import DEFAULT_SAFE_MODULES
from .. import guards

log = logging.getLogger("zero_offload")

# Said once per process: accelerate's DeepSpeed wrapper (the Trainer's route) calls
# set_gradient_accumulation_boundary before every backward.
ZENFLOW_BOUNDARY_NOTE = (
    "set_gradient_accumulation_boundary(True) on a ZenFlow engine (accelerate, the Hugging Face "
    "Trainer): zero_optimization.zenflow.update_interval and select_interval keep their "
    "schedule here, each boundary being one ZenFlow step. DeepSpeed 0.19.8 lets this override "
    "end every step's update interval instead (a host update at every boundary), so its "
    "Trainer runs differ from its own engine loop and from this one (docs/zenflow.md)"
)
_zenflow_boundary_noted = False


class LossScale(float):
    """``engine.loss_scale``: the current loss scale as a number (this project's property), and
    callable as DeepSpeed's method ``engine.loss_scale()``, which returns the *configured*
    ``fp16.loss_scale`` (0.0 means dynamic)."""

    configured: float = 0.0

    def __new__(cls, current: float, configured: float) -> LossScale:
        obj = super().__new__(cls, current)
        obj.configured = float(configured)
        return obj

    def __call__(self) -> float:
        return self.configured

    def __reduce__(self):  # pickles, copies and saves as the plain number it is
        return (float, (float(self),))


class DeepSpeedEngineAPI:
    """Mixed into ZeroOffloadEngine; uses its ``config``, counters and ``stage``."""

    def collect_python_gc(self) -> int:
        """Run Python's cyclic garbage collection now (``disable_python_gc`` keeps the automatic
        one off); the number of objects collected."""
        return gc.collect()

    _before_step_counts: tuple[int, int] | None = None  # (global, skipped) steps before step()

    # ---- accumulation window (window.py) -------------------------------------------------------
    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the current micro-batch ends the accumulation window (DeepSpeed's rule:
        the counter, unless :meth:`set_gradient_accumulation_boundary` overrode it). With
        ``managed_gradient_accumulation`` false: True only while ``step()`` runs."""
        return self.window.is_boundary(self.global_steps, self.micro_steps)

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Override the counter: set False before each non-final micro-batch's forward/backward
        and True before the final one, then call ``step()`` once."""
        if not isinstance(is_boundary, bool):
            raise ValueError(
                f"set_gradient_accumulation_boundary: is_boundary must be a bool, got {is_boundary!r}"
            )
        if not self.window.managed:  # DeepSpeed asserts this: an AssertionError as well
            raise guards.EngineAssertionError(
                "set_gradient_accumulation_boundary() with managed_gradient_accumulation false: "
                "the caller owns the boundary by calling step()"
            )
        self.window.boundary_override = is_boundary
        global _zenflow_boundary_noted
        if is_boundary and not _zenflow_boundary_noted and self.zero_plan.zenflow is not None:
            _zenflow_boundary_noted = True
            log.warning(ZENFLOW_BOUNDARY_NOTE)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally without reducing them; the next
        boundary backward outside reduces the sum. Stages 0 and 1 only (stage 2 partitions
        gradients during backward); ``step()`` inside is an error; not re-entrant."""
        if self.stage >= 2:
            raise guards.EngineAssertionError(
                f"no_sync context manager is incompatible with gradient partitioning logic of "
                f"ZeRO stage {self.stage}; it works with zero_optimization.stage 0 or 1"
            )
        if self.window.inside_no_sync:
            raise guards.EngineAssertionError("no_sync context manager reentry is unsupported")
        self.window.inside_no_sync = True
        try:
            yield
        finally:
            self.window.inside_no_sync = False

    @contextlib.contextmanager
    def coalesce_grad_reduction(self) -> Iterator[None]:
        """DeepSpeed's: every ``backward()`` inside accumulates without ending the window, and
        the exit ends it once (stages 0/1 reduce the summed gradients then; stages 2/3, which
        reduce-scatter inside each backward, finalize the shards), as ``step()`` does with
        ``managed_gradient_accumulation`` false. One block is one optimizer step: ``step()``
        inside raises, as does a backward after the block before ``step()``. Stages 1-3; not
        nested with ``no_sync``."""
        if not self.window.managed:
            raise guards.EngineAssertionError(
                "coalesce_grad_reduction is not supported with managed_gradient_accumulation="
                "False; the caller already owns the accumulation boundary via step()"
            )
        if self.stage == 0:
            raise NotImplementedError(
                "coalesce_grad_reduction requires ZeRO stage 1/2/3, got stage 0"
            )
        if self.window.inside_no_sync:
            raise guards.EngineAssertionError(
                "coalesce_grad_reduction cannot be nested inside another no_sync context"
            )
        self.window.inside_no_sync = True  # no backward inside ends the window
        try:
            yield
        finally:
            self.window.inside_no_sync = False
            if self.window.backward_since_step:
                self.reducer.finish_window()
                self.window.end_by_block()

    def was_step_applied(self) -> bool:
        """Whether the latest ``step()`` changed the parameters (False between accumulation
        boundaries, after an fp16 overflow skip, and before any step)."""
        if self._before_step_counts is None:
            return False
        steps, skipped = self._before_step_counts
        return self.global_steps > steps and self.skipped_steps == skipped

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch size by changing the accumulation steps (the micro batch
        stays). Call between windows (after a boundary ``step()``)."""
        micro, world = self.train_micro_batch_size_per_gpu(), self.world_size
        if (
            isinstance(train_batch_size, bool)
            or not isinstance(train_batch_size, int)
            or train_batch_size < 1
            or train_batch_size % (micro * world) != 0
        ):
            raise ValueError(
                f"set_train_batch_size: train_batch_size must be a positive multiple of "
                f"train_micro_batch_size_per_gpu {micro} * world size {world} = {micro * world}, "
                f"got {train_batch_size!r}"
            )
        if not self.window.at_start(self.global_steps, self.micro_steps):
            raise RuntimeError(
                "set_train_batch_size: called inside an accumulation window; call it after the "
                "boundary step()"
            )
        new_gas = train_batch_size // (micro * world)
        if new_gas > 1:
            for og in self.opt_groups:
                og.grads.ensure_device_accumulator()
        self.window.gas = new_gas
        self.config = self.config.updated(
            {"train_batch_size": train_batch_size, "gradient_accumulation_steps": new_gas}
        )

    # ---- configuration accessors ---------------------------------------------------------------
    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def zero_optimization_stage(self) -> int:
        return int(self.stage)

    def fp16_enabled(self) -> bool:
        return bool(self.config.fp16.enabled)

    def bfloat16_enabled(self) -> bool:
        return bool(self.config.bf16.enabled)

    def managed_gradient_accumulation(self) -> bool:
        """DeepSpeed's: whether the engine counts micro-steps (false: every step() updates)."""
        return self.window.managed

    def torch_autocast_enabled(self) -> bool:
        return self.autocast.enabled

    def torch_autocast_dtype(self) -> torch.dtype | None:
        """DeepSpeed's: the configured autocast dtype (None when not given)."""
        return self.config.torch_autocast.torch_dtype

    def torch_autocast_lower_precision_safe_modules(self) -> list[str]:
        names = self.config.torch_autocast.lower_precision_safe_modules
        if names is None:
            return [f"{c.__module__}.{c.__name__}" for c in DEFAULT_SAFE_MODULES]
        return list(names)

    def gradient_clipping(self) -> float:
        return float(self.config.gradient_clipping)

    def dynamic_loss_scale(self) -> bool:
        # DeepSpeed: fp16.loss_scale == 0, whether or not fp16 is enabled.
        return float(self.config.fp16.loss_scale) == 0.0

    def steps_per_print(self) -> int | None:
        return self.config.steps_per_print

    def zero_offload_optimizer(self):
        """The ``offload_optimizer`` config section, or None."""
        return self.config.zero_optimization.offload_optimizer

    def zero_cpu_offload(self) -> bool:
        return self.config.zero_optimization.offload_device == "cpu"

    def zero_partial_offload(self) -> float:
        """DeepSpeed's accessor: ``offload_optimizer.ratio`` (1.0 without the section)."""
        oc = self.config.zero_optimization.offload_optimizer
        return float(oc.ratio) if oc is not None else 1.0

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """(model dtype, gradient accumulation dtype): ``data_types.grad_accum_dtype`` when set
        (stages 2/3), else the model dtype."""
        return (self.dtype, self.grad_accum_dtype)

    @property
    def loss_scale(self) -> LossScale:
        return LossScale(self.loss_scaler.loss_scale, self.config.fp16.loss_scale)

    def save_fp16_model(self, save_dir, save_filename: str = "pytorch_model.bin"):
        """DeepSpeed's old name of ``save_16bit_model`` (same default file name as DeepSpeed's)."""
        return self.save_16bit_model(save_dir, save_filename)
