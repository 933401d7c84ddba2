"""``"auto"`` bucket and threshold sizes, filled from the model's hidden size h as Hugging Face's
DeepSpeed integration fills them: ``reduce_bucket_size`` = h*h, and at stage 3
``stage3_prefetch_bucket_size`` = int(0.9*h*h) and ``stage3_param_persistence_threshold`` = 10*h.

Loading a config turns every ``"auto"`` into the default (the model is not known yet) and records
its key path; the engine calls :func:`resolve_auto_sizes` once it has the model, and runs with
the new config it returns (a validated config is never changed in place).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..fields import INT64_MAX
from ..models import ZeroOffloadConfig

log = logging.getLogger("zero_offload")

SECTION = "zero_optimization"


@dataclass(frozen=True)
class _AutoSize:
    name: str  # the ZeroConfig field
    spellings: tuple[str, ...]  # every JSON key that sets it
    size: Callable[[int], int]  # from the hidden size
    stage3_only: bool  # no effect below stage 3, so not filled there (as Hugging Face does)
    rule: str  # ``size`` as written in messages


_AUTO_SIZES = (
    _AutoSize("reduce_bucket_size", ("reduce_bucket_size",), lambda h: h * h, False, "h*h"),
    _AutoSize(
        "stage3_prefetch_bucket_size",
        ("stage3_prefetch_bucket_size", "prefetch_bucket_size"),
        lambda h: int(0.9 * h * h),
        True,
        "int(0.9*h*h)",
    ),
    _AutoSize(
        "stage3_param_persistence_threshold",
        ("stage3_param_persistence_threshold", "param_persistence_threshold"),
        lambda h: 10 * h,
        True,
        "10*h",
    ),
)


def auto_sizes(hidden: int) -> dict[str, int]:
    """Every ``"auto"`` size for a model of hidden size ``hidden``, by ZeroConfig field name."""
    return {a.name: a.size(hidden) for a in _AUTO_SIZES}


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def model_hidden_size(module: Any) -> int | None:
    """``module.config.hidden_size``, else the largest of ``module.config.hidden_sizes`` (models
    with several stages), else None."""
    model_config = getattr(module, "config", None)
    hidden = getattr(model_config, "hidden_size", None)
    if _positive_int(hidden):
        return hidden
    sizes = getattr(model_config, "hidden_sizes", None)
    if isinstance(sizes, (list, tuple)) and sizes and all(_positive_int(s) for s in sizes):
        return max(sizes)
    return None


def resolve_auto_sizes(
    config: ZeroOffloadConfig, module: Any
) -> tuple[ZeroOffloadConfig, dict[str, int]]:
    """Fill the size keys the source config set to ``"auto"`` from ``module``'s hidden size.

    Returns the config with those sizes (a new validated one; ``config`` itself when nothing
    is filled) and ``{field name: value}`` for what was filled, logging one info line. A model
    without a hidden size keeps the defaults, with one warning naming the keys. Stage-3 keys
    are filled only at stage 3.
    """
    zero = config.zero_optimization
    wanted = [
        auto
        for auto in _AUTO_SIZES
        if (zero.stage == 3 or not auto.stage3_only)
        and any(f"{SECTION}.{key}" in config.auto_keys for key in auto.spellings)
    ]
    if not wanted:
        return config, {}
    hidden = model_hidden_size(module)
    if hidden is None:
        kept = ", ".join(f"{SECTION}.{a.name}={getattr(zero, a.name)}" for a in wanted)
        warnings.warn(
            f'"auto" sizes need the model\'s config.hidden_size (or hidden_sizes), which '
            f"{type(module).__name__} does not have; keeping the defaults: {kept}",
            UserWarning,
            stacklevel=2,
        )
        return config, {}
    chosen, problems = {}, []
    for a in wanted:
        try:
            value = a.size(hidden)
        except OverflowError:  # int(0.9 * h * h) past a float's range
            value = None
        if value is None or value > INT64_MAX:
            key = next(k for k in a.spellings if f"{SECTION}.{k}" in config.auto_keys)
            problems.append(
                f'{SECTION}.{key}: "auto" is {a.rule} for the model\'s hidden_size h={hidden}, '
                f"which is past 2**63 - 1 (a size must fit in a signed 64-bit integer); set "
                f"{key} to a number"
            )
        else:
            chosen[a.name] = value
    if problems:
        raise ConfigError(problems)
    resolved = config.updated({SECTION: chosen})
    log.info(
        '"auto" sizes from the model\'s hidden_size %d: %s',
        hidden,
        ", ".join(f"{SECTION}.{name}={value}" for name, value in chosen.items()),
    )
    return resolved, chosen
