"""``deepspeed.launcher``: only ``runner.DEEPSPEED_ENVIRONMENT_NAME`` (``accelerate launch
--use_deepspeed`` imports it). The ``deepspeed`` command-line launcher itself is not provided:
launch with torchrun, ``accelerate launch`` (one node, or ``--deepspeed_multinode_launcher
standard``) or ``zero-offload launch``."""

from .._common import not_provided_getattr
from . import runner  # noqa: F401

__getattr__ = not_provided_getattr(__name__)
