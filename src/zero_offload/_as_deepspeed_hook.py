"""Run at interpreter start by ``zero_offload_as_deepspeed.pth`` (which imports this module only
when ``ZERO_OFFLOAD_AS_DEEPSPEED`` is in the environment): turns the DeepSpeed opt-in on when the
variable is true. Imports neither torch nor the namespace (see ``zero_offload._as_deepspeed``)."""

from ._as_deepspeed import activate_from_environment

activate_from_environment()
