"""``deepspeed.runtime``: the engine, the LR schedules, activation checkpointing and ZeRO (``deepspeed.zero`` is
``deepspeed.runtime.zero``, as in DeepSpeed)."""

from .._common import not_provided_getattr
from . import (  # noqa: F401 (DeepSpeed has them loaded)
    activation_checkpointing,
    config,
    engine,
    fp16,
    lr_schedules,
    zero,
)

__getattr__ = not_provided_getattr(__name__)
