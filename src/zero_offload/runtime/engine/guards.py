"""Checks on how the engine is driven, each a clear error instead of silent damage later.

Invariants the engine relies on, enforced here:

- one engine per model: a param already wired to a live engine (its ``partitioned.engine_link``) is
  not wired again, since both engines' hooks would then fire on every gradient;
- ``backward(loss)`` gets the scalar tensor the forward returned, and runs no more after the
  backward that ended the accumulation window (it already reduced) until ``step()``;
- ``step()`` follows a ``backward()`` in the same micro-step (a window with no backward would
  apply the previous gradient again, or none, while reporting a norm);
- no non-finite hyperparameter (set by an LR scheduler or the caller) reaches an update.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

import torch

from ...core import partitioned
from ..errors import EngineAssertionError as EngineAssertionError  # re-exported: callers catch it
from ..errors import EngineUsageError
from ..errors import check_alive as check_alive  # re-exported: the engine's own guard

log = logging.getLogger("zero_offload")


class NonFiniteHyperparameterError(ValueError):
    """A learning rate, beta, eps or weight decay became NaN or infinite before an update."""


def take_over(params: Iterable[torch.nn.Parameter]) -> None:
    """A model still wrapped by an engine (not destroyed: maybe dropped, which at stage 3 keeps
    it alive through the model's hooks) is released from it first, with a warning; that engine
    then refuses to run. A collective, as initialize() is: every rank destroys the same one."""
    for p in params:
        link = partitioned.engine_link(p)
        old = link.engine() if link is not None else None
        if old is not None and not old.destroyed:
            log.warning(
                "initialize(): this model is still wrapped by an earlier engine that was not "
                "destroyed; destroying it (its forward/backward/step now raise) and wrapping the "
                "model anew. Call engine.destroy() yourself to silence this."
            )
            old.destroy()
            return


def check_materialized(module: torch.nn.Module) -> None:
    """Params still on the meta device have no values to train (a model built with
    ``device="meta"`` or ``skip_init`` whose ``to_empty`` was never called): refuse, naming them."""
    meta = [n for n, p in module.named_parameters() if p.is_meta]
    meta += [n for n, b in module.named_buffers() if b.is_meta]
    if meta:
        shown = ", ".join(meta[:3]) + (f" and {len(meta) - 3} more" if len(meta) > 3 else "")
        raise ValueError(
            f"initialize: {len(meta)} param(s)/buffer(s) are on the meta device and hold no "
            f"values: {shown}. Give them storage first (module.to_empty(device=...) and an "
            "init, or load a state dict with assign=True)"
        )


def check_trained(module: torch.nn.Module, known: set[int]) -> None:
    """Before an update: every param that requires grad is one the engine trains, or one it
    was told to leave out (``known``: the params that required grad at initialize()). A param created or unfrozen
    later has no optimizer state or gradient buffer, so it would silently never train."""
    for p in module.parameters():
        if p.requires_grad and id(p) not in known and partitioned.engine_link(p) is None:
            name = next(n for n, q in module.named_parameters() if q is p)
            raise EngineUsageError(
                f"parameter {name!r} requires grad but this engine does not train it: it was "
                "created or unfrozen after initialize(), which built the optimizer state and "
                "gradient buffers. Set requires_grad and add modules before initialize(), or "
                "initialize a new engine"
            )


class LossShapeError(ValueError, AssertionError):
    """A loss that is not one element: DeepSpeed asserts it (an AssertionError); a ValueError
    as well, as this project raised it before."""


def check_loss(loss: object, api: str = "engine.backward(loss)") -> torch.Tensor:
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"{api}: loss must be the scalar torch.Tensor your model's forward "
            f"returned (it carries the graph to differentiate), got {type(loss).__name__} "
            f"{loss!r}"
        )
    if loss.numel() != 1:
        raise LossShapeError(
            f"{api}: loss must be a scalar tensor (one element), got shape "
            f"{tuple(loss.shape)}; reduce it first, e.g. loss.mean(), or for a non-scalar "
            "output call output.backward(grad)"
        )
    if not loss.requires_grad:
        raise ValueError(
            f"{api}: loss does not require grad (computed under torch.no_grad(), "
            "detached, or from a model without trainable parameters)"
        )
    return loss


class NoOptimizerError(EngineUsageError, AssertionError):
    """Training an engine built without an optimizer (DeepSpeed asserts there)."""


def check_has_optimizer(optimizer: object, what: str) -> None:
    if optimizer is None:
        raise NoOptimizerError(
            f"engine.{what}(): this engine has no optimizer (initialize() got none and the config "
            "has no 'optimizer' block, or the model has no trainable parameter): it runs forward "
            "only. Pass optimizer= or add an 'optimizer' block to train."
        )


def backward_after_block_error() -> EngineUsageError:
    return EngineUsageError(
        "engine.backward() after a coalesce_grad_reduction() block, before engine.step(): the "
        "block is one optimizer step and its exit already reduced the gradients. Call "
        "engine.step() first, or run this backward inside the block."
    )


def reopen_without_end_error() -> EngineUsageError:
    return EngineUsageError(
        "engine.backward() after the backward that ended the accumulation window, before "
        "engine.step(), inside no_sync() or after set_gradient_accumulation_boundary(False): "
        "such a backward adds to the window's reduced gradient and must end the window again, "
        "else its gradient would miss the step. Call engine.step() first, or let it end the "
        "window."
    )


def unscaled_backward_error() -> EngineUsageError:
    return EngineUsageError(
        "Loss scaling is required for this configuration, but backward() was called directly "
        "without scaling the loss: with fp16 enabled call engine.scale(loss).backward() or "
        "engine.backward(loss). An unscaled fp16 backward underflows small gradients to zero."
    )


def step_without_backward_error(global_steps: int) -> EngineUsageError:
    return EngineUsageError(
        f"engine.step() with no engine.backward() since the last step() (at global step "
        f"{global_steps}): there is no gradient for this micro-step. Call "
        "engine.backward(loss) once before every engine.step()."
    )


def check_hyperparameters(param_groups: list[dict], global_steps: int) -> None:
    """Raise before an update that would write NaN/inf into the weights."""
    for i, g in enumerate(param_groups):
        for key in ("lr", "eps", "weight_decay", "betas"):
            value = g.get(key)
            values = value if isinstance(value, list | tuple) else [value]
            for v in values:
                if v is not None and not math.isfinite(float(v)):
                    raise NonFiniteHyperparameterError(
                        f"param_groups[{i}][{key!r}] is {value} at global step {global_steps} "
                        "(set by the LR scheduler or by the caller); refusing to update, since "
                        "a non-finite hyperparameter turns every weight into NaN"
                    )
