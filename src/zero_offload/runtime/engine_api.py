"""DeepSpeed's engine accessors and accumulation controls, as a mixin of the engine.

Each method is DeepSpeed's name, signature and meaning (``deepspeed/runtime/engine.py``) over
state the engine already has. The accumulation controls (``set_gradient_accumulation_boundary``,
``no_sync``, ``set_train_batch_size``) feed the engine through three questions it asks before
every backward and step: :meth:`is_gradient_accumulation_boundary`, :meth:`_first_micro_step`
and :meth:`_reduces_now`.

Invariant: an accumulation window starts at the first ``backward`` after a step was taken
(``global_steps`` moved, whether the step was applied or skipped) and ends at the backward that
is a boundary. The window start is recovered lazily from the counters, so the engine's step code
needs no bookkeeping for it, and a load that rewrites the counters starts a new window.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from . import guards


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

    # Class-level defaults so the engine's __init__ needs no lines for them.
    _boundary_override: bool | None = None
    _inside_no_sync: bool = False
    _window_start: int = 0  # micro_steps at the first backward of the current window
    _window_steps: int = 0  # global_steps when _window_start was last set
    _step_applied: bool = False
    _before_step_counts: tuple[int, int] | None = None

    # ---- accumulation window -------------------------------------------------------------------
    def _sync_window(self) -> None:
        if self.global_steps != self._window_steps:
            self._window_steps = self.global_steps
            self._window_start = self.micro_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the current micro-batch ends the accumulation window (DeepSpeed's rule:
        the counter, unless :meth:`set_gradient_accumulation_boundary` overrode it). With
        ``managed_gradient_accumulation`` false: True only while ``step()`` runs."""
        if not self.managed_accumulation:
            return self._in_unmanaged_step
        if self._boundary_override is not None:
            return self._boundary_override
        self._sync_window()
        return (self.micro_steps - self._window_start + 1) % self._gas == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Override the counter: set False before each non-final micro-batch's forward/backward
        and True before the final one, then call ``step()`` once."""
        if not isinstance(is_boundary, bool):
            raise ValueError(
                f"set_gradient_accumulation_boundary: is_boundary must be a bool, got {is_boundary!r}"
            )
        if not self.managed_accumulation:
            raise guards.EngineUsageError(
                "set_gradient_accumulation_boundary() with managed_gradient_accumulation false: "
                "the caller owns the boundary by calling step()"
            )
        self._boundary_override = is_boundary

    def _first_micro_step(self) -> bool:
        """Does the coming backward start a new accumulation window (nothing accumulated yet)?"""
        self._sync_window()
        return self.micro_steps == self._window_start and not self._window_touched()

    def _window_touched(self) -> bool:
        # A backward in the window already ran (no_sync, or a boundary override that keeps
        # micro_steps still): recorded by _reduces_now below.
        return getattr(self, "_window_backwards_at", None) == (self.global_steps, self.micro_steps)

    def _reduces_now(self) -> bool:
        """Does the coming backward end the window (reduce at stages 0/1)? Records that the
        window has seen a backward."""
        self._window_backwards_at = (self.global_steps, self.micro_steps)
        last = not self._inside_no_sync and self.is_gradient_accumulation_boundary()
        if not last:  # a window of several backwards (built with GAS 1: allocated now)
            for gs in self.grad_shards:
                gs.ensure_device_accumulator()
        return last

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
        if self._inside_no_sync:
            raise guards.EngineAssertionError("no_sync context manager reentry is unsupported")
        self._inside_no_sync = True
        try:
            yield
        finally:
            self._inside_no_sync = False

    def _before_step(self) -> None:
        """Called first thing in ``step()``."""
        if self._inside_no_sync:
            raise guards.EngineAssertionError(
                "it is illegal to call engine.step() inside no_sync context manager"
            )
        self._before_step_counts = (self.global_steps, self.skipped_steps)

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
        self._sync_window()
        if self.micro_steps != self._window_start or self._window_touched():
            raise RuntimeError(
                "set_train_batch_size: called inside an accumulation window; call it after the "
                "boundary step()"
            )
        new_gas = train_batch_size // (micro * world)
        if new_gas > 1:
            for gs in self.grad_shards:
                gs.ensure_device_accumulator()
        self._gas = new_gas
        self.config.train_batch_size = train_batch_size
        self.config.gradient_accumulation_steps = new_gas

    # ---- configuration accessors ---------------------------------------------------------------
    def zero_optimization_stage(self) -> int:
        return int(self.stage)

    def fp16_enabled(self) -> bool:
        return bool(self.config.fp16.enabled)

    def bfloat16_enabled(self) -> bool:
        return bool(self.config.bf16.enabled)

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
