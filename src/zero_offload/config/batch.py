"""The batch triple: train_batch_size = micro batch per rank * accumulation steps * world size.

Any two of the three imply the third; one alone follows DeepSpeed's rules (the missing ones
with gradient_accumulation_steps 1); ``"auto"`` (Hugging Face style) counts as not given. The
caller may supply the micro batch from outside the config (a launcher's ``--batch-size``), as
the Hugging Face integration fills ``"auto"`` from its own arguments.
"""

from __future__ import annotations

from typing import NamedTuple

from .errors import ConfigError

TBS = "train_batch_size"
MICRO = "train_micro_batch_size_per_gpu"
GAS = "gradient_accumulation_steps"
MAX_GAS = 1_000_000


class BatchSizes(NamedTuple):
    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int


def _outside_micro(micro: int | None, micro_batch_size: int | None) -> int | None:
    """The micro batch per rank once ``micro_batch_size`` (given from outside the config, as a
    launcher's ``--batch-size``) is checked against the config's ``micro``."""
    if micro_batch_size is not None:
        if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int):
            raise ConfigError(
                f"micro_batch_size must be a positive integer, got {micro_batch_size!r}"
            )
        if micro_batch_size < 1:
            raise ConfigError(
                f"micro_batch_size must be a positive integer, got {micro_batch_size}"
            )
        if micro is not None and micro != micro_batch_size:
            raise ConfigError(
                f"{MICRO} {micro} in the config != micro_batch_size {micro_batch_size} "
                f"given with it (a script's --batch-size); change --batch-size to {micro}, or "
                f"the config's {MICRO} to {micro_batch_size} (or remove it)"
            )
        micro = micro_batch_size
    return micro


def _complete(
    tbs: int | None, micro: int | None, gas: int | None, world_size: int
) -> tuple[BatchSizes, str]:
    """The triple with its missing members filled in, unchecked, and how a floor division
    derived one ("" when none did); a ConfigError when no batch size is given."""
    derived = ""
    if tbs is not None and micro is not None and gas is None:
        gas = tbs // (micro * world_size)
        derived = f"{GAS} derived as {tbs} // ({micro} * {world_size}) = {gas}"
    elif tbs is not None and gas is not None and micro is None:
        micro = tbs // (gas * world_size)
        derived = f"{MICRO} derived as {tbs} // ({gas} * {world_size}) = {micro}"
    elif micro is not None and gas is not None and tbs is None:
        tbs = micro * gas * world_size
    elif tbs is not None and micro is None and gas is None:
        gas = 1
        micro = tbs // world_size
        derived = f"{MICRO} derived as {tbs} // (1 * {world_size}) = {micro}"
    elif micro is not None and tbs is None and gas is None:
        gas = 1
        tbs = micro * world_size
    elif tbs is None and micro is None:
        given = f" ({GAS} alone does not determine it)" if gas is not None else ""
        raise ConfigError(f"no batch size given: set {TBS} or {MICRO}{given}")

    assert tbs is not None and micro is not None and gas is not None
    return BatchSizes(tbs, micro, gas), derived


def _check(sizes: BatchSizes, world_size: int, derived: str) -> None:
    """A ConfigError unless the triple multiplies out, is positive and accumulates sanely."""
    tbs, micro, gas = sizes
    if tbs != micro * gas * world_size or micro < 1 or gas < 1:
        note = f" ({derived})" if derived else ""
        raise ConfigError(
            f"{TBS} {tbs} != {MICRO} {micro} * {GAS} {gas} * world_size {world_size} "
            f"= {micro * gas * world_size}{note}"
        )
    if gas > MAX_GAS:
        raise ConfigError(
            f"{GAS} {gas} is beyond any sane accumulation (at most {MAX_GAS:,} micro-steps per "
            "update): a typo? One update would take that many forward/backward passes"
        )


def resolve_batch_sizes(
    train_batch_size: int | None,
    train_micro_batch_size_per_gpu: int | None,
    gradient_accumulation_steps: int | None,
    world_size: int,
    *,
    micro_batch_size: int | None = None,
) -> BatchSizes:
    """Resolve the triple for ``world_size`` ranks; a ConfigError shows the arithmetic."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be a positive integer, got {world_size!r}")
    micro = _outside_micro(train_micro_batch_size_per_gpu, micro_batch_size)
    sizes, derived = _complete(train_batch_size, micro, gradient_accumulation_steps, world_size)
    _check(sizes, world_size, derived)
    return sizes
