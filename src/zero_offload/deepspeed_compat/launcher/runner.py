"""``deepspeed.launcher.runner``: the name of the environment file DeepSpeed's multi-node
launcher passes to every node (read by accelerate; the launcher itself is not provided)."""

import os

from .._common import not_provided_getattr

DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")

__getattr__ = not_provided_getattr(
    __name__, {"main": " (launch with torchrun, accelerate launch or zero-offload launch)"}
)
