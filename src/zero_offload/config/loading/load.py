"""``load_config``: from a JSON file, a dict or a config to a validated :class:`ZeroOffloadConfig`."""

from __future__ import annotations

import copy
import os
import warnings
from typing import Any

from pydantic import ValidationError

from ..errors import ConfigError, NotImplementedSettingWarning, SettingSpellingWarning
from ..models import ZeroOffloadConfig
from . import unbuilt
from .auto import AutoValueWarning, auto_report
from .dotted import expand_dotted_keys
from .finite import non_finite_numbers
from .json_text import read_json_file
from .keys import Prepared, describe_errors, prepare
from .origin import origin_of
from .removed import removed_problems, without_removed

ConfigSource = str | os.PathLike[str] | dict[str, Any] | ZeroOffloadConfig


def _legacy_forms(raw: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """DeepSpeed's older spellings, rewritten to the current ones."""
    raw = dict(raw)
    if "bfloat16" in raw:
        old = raw.pop("bfloat16")
        if "bf16" in raw and raw["bf16"] != old:
            problems.append('"bfloat16" is the old name of "bf16"; give one, not both')
        raw.setdefault("bf16", old)
    zero = raw.get("zero_optimization")
    if isinstance(zero, bool):
        # DeepSpeed's first format: true meant stage 1, with the top-level "allgather_size"
        # as its allgather bucket size (read_zero_config_deprecated). Otherwise DeepSpeed
        # ignores "allgather_size", and it is listed as ignored here.
        raw["zero_optimization"] = {"stage": 1 if zero else 0}
        if zero and "allgather_size" in raw:
            raw["zero_optimization"]["allgather_bucket_size"] = raw.pop("allgather_size")
    return raw


def _unused_nvme_paths(config: ZeroOffloadConfig) -> list[str]:
    """``nvme_path`` given for an offload whose device is not NVMe: DeepSpeed ignores it too,
    but never silently here."""
    zc = config.zero_optimization
    out = []
    for name, section in (
        ("offload_optimizer", zc.offload_optimizer),
        ("offload_param", zc.offload_param),
    ):
        if section is not None and section.nvme_path is not None and section.device != "nvme":
            out.append(f"zero_optimization.{name}.nvme_path (device is {section.device!r})")
    return out


def _read_source(source: ConfigSource) -> tuple[str, dict[str, Any]]:
    """The origin named in messages and a private copy of the raw config dict of ``source``."""
    if isinstance(source, ZeroOffloadConfig):
        origin = "<ZeroOffloadConfig>"
        raw = copy.deepcopy(source._source) if source._source is not None else source.to_dict()
    elif isinstance(source, dict):
        origin = origin_of(source) or "<dict>"
        raw = copy.deepcopy(source)
    elif isinstance(source, (str, os.PathLike)):
        origin = os.fspath(source)
        raw = read_json_file(source)
    else:
        raise ConfigError(
            f"config source must be a JSON file path, a dict or a ZeroOffloadConfig, "
            f"got {type(source).__name__}"
        )
    return origin, raw


def _validate(
    raw: dict[str, Any],
    world_size: int,
    micro_batch_size: int | None,
    origin: str,
) -> tuple[ZeroOffloadConfig, Prepared]:
    """The validated config and its prepared keys; a ConfigError lists every problem in ``raw``."""
    problems: list[str] = non_finite_numbers(raw)
    expanded = expand_dotted_keys(raw, ZeroOffloadConfig, problems)
    normalized = _legacy_forms(expanded, problems)
    problems.extend(removed_problems(normalized))  # DeepSpeed 0.19.8 refuses these by key
    normalized = without_removed(normalized)
    prepared = prepare(normalized, ZeroOffloadConfig)
    problems.extend(prepared.problems)
    config: ZeroOffloadConfig | None = None
    try:
        config = ZeroOffloadConfig.model_validate(
            prepared.data,
            context={
                "world_size": world_size,
                "micro_batch_size": micro_batch_size,
                "source": raw,
                "ignored": prepared.ignored,
                "auto": prepared.auto,
            },
        )
    except ValidationError as exc:
        reported = {line.split(":", 1)[0] for line in problems}  # one line per key
        problems.extend(
            line
            for line in describe_errors(ZeroOffloadConfig, exc, prepared.auto)
            if line.split(":", 1)[0] not in reported
        )
    if problems or config is None:
        raise ConfigError(problems, origin=origin)
    return config, prepared


def _warn_loaded(config: ZeroOffloadConfig, prepared: Prepared, origin: str) -> None:
    """The load-time warnings: unfilled ``"auto"`` keys, an aio spelling conflict, and settings
    accepted but ignored. Called from :func:`load_config` only: ``stacklevel=3`` names its
    caller, as ``stacklevel=2`` did when these lines were in ``load_config``."""
    defaulted = auto_report(prepared.auto, prepared.ignored, config.to_dict())
    if defaulted:
        warnings.warn(
            f'{origin}: "auto" has nothing to fill it here, so the default is used: '
            f"{', '.join(defaulted)} (give values to silence this)",
            AutoValueWarning,
            stacklevel=3,
        )
    unimplemented = [
        *unbuilt.notes(prepared.ignored_values),
        *unbuilt.default_only_notes(config.non_default_unimplemented()),
        *_unused_nvme_paths(config),
    ]
    conflict = config.aio.spelling_conflict() if config.zero_optimization.uses_nvme else None
    if conflict:  # the aio section is read only with an NVMe offload
        warnings.warn(f"{origin}: {conflict}", SettingSpellingWarning, stacklevel=3)
    if unimplemented:
        warnings.warn(
            f"{origin}: DeepSpeed settings accepted but not built here, so this run differs "
            f"from DeepSpeed's: {'; '.join(unimplemented)}",
            NotImplementedSettingWarning,
            stacklevel=3,
        )


def load_config(
    source: ConfigSource,
    world_size: int = 1,
    *,
    micro_batch_size: int | None = None,
) -> ZeroOffloadConfig:
    """Validate a DeepSpeed-style config for a run on ``world_size`` data-parallel ranks.

    ``source`` is a path to a JSON file, a dict (not modified), or a ZeroOffloadConfig (returned
    as is when already resolved for this world size, else re-resolved from its source).
    A top-level key written with dots (``"zero_optimization.reduce_bucket_size"``, as TRL's
    ``prepare_deepspeed`` writes them) is the nested key it spells (:mod:`.dotted`).
    ``micro_batch_size`` supplies ``train_micro_batch_size_per_gpu`` from outside the config,
    as a launcher's ``--batch-size`` does for DeepSpeed's Megatron examples; it must agree with
    the config's value when both are given.

    Raises ConfigError listing every problem, one per line, each naming its key path. Warns
    once (NotImplementedSettingWarning) listing the DeepSpeed settings accepted but ignored,
    (only those whose value changes training, each with what differs from DeepSpeed), once
    (AutoValueWarning) listing each ``"auto"`` key nothing could fill, with the
    default chosen, and once (SettingSpellingWarning, with an NVMe offload only) when
    ``aio.thread_count`` and ``aio.intra_op_parallelism`` disagree. ``config.auto_keys`` lists
    every ``"auto"`` key path given.
    """
    if isinstance(source, ZeroOffloadConfig):
        if source.world_size == world_size and micro_batch_size is None:
            return source
    origin, raw = _read_source(source)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be a positive integer, got {world_size!r}")
    config, prepared = _validate(raw, world_size, micro_batch_size, origin)
    _warn_loaded(config, prepared, origin)
    return config
