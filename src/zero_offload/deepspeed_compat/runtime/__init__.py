"""``deepspeed.runtime``: the engine, the LR schedules and ZeRO (``deepspeed.zero`` is
``deepspeed.runtime.zero``, as in DeepSpeed)."""

from .._common import not_provided_getattr
from . import config, engine, fp16, lr_schedules, zero  # noqa: F401 (DeepSpeed has them loaded)

__getattr__ = not_provided_getattr(__name__)
