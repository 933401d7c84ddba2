"""``deepspeed.utils.logging``: the logger (zero_offload's: setting its level, as transformers
does from ``TrainingArguments``, sets zero_offload's), ``log_dist`` and DeepSpeed's level-by-name
helpers."""

from __future__ import annotations

import logging

logger = logging.getLogger("zero_offload")

log_levels: dict[str, int] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


def get_log_level_from_string(log_level_str: str) -> int:
    """``"info"`` (any case) -> ``logging.INFO``; another name is a ValueError listing the
    allowed ones."""
    level = log_levels.get(str(log_level_str).lower())
    if level is None:
        raise ValueError(
            f"{log_level_str!r} is not one of the valid logging levels; valid: "
            f"{', '.join(log_levels)}"
        )
    return level


def set_log_level_from_string(log_level_str: str, custom_logger: logging.Logger | None = None):
    """Set ``custom_logger`` (default: the namespace's logger) and each of its handlers to the
    named level."""
    level = get_log_level_from_string(log_level_str)
    target = logger if custom_logger is None else custom_logger
    target.setLevel(level)
    for handler in target.handlers:
        handler.setLevel(level)


def log_dist(message: str, ranks=None, level: int = logging.INFO) -> None:
    """DeepSpeed's: log ``message`` on the listed ranks (None or containing -1: every rank)."""
    from ..comm import get_rank

    rank = get_rank()
    if ranks is None or -1 in ranks or rank in ranks:
        logger.log(level, "[Rank %d] %s", rank, message)
