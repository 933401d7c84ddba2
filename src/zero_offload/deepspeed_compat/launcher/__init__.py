"""``deepspeed.launcher``: ``runner.main`` (the ``deepspeed`` command: ``zero-offload launch``
with DeepSpeed's launcher flags) and ``runner.DEEPSPEED_ENVIRONMENT_NAME`` (``accelerate launch
--use_deepspeed`` imports it)."""

from .._common import not_provided_getattr
from . import runner  # noqa: F401

__getattr__ = not_provided_getattr(__name__)
