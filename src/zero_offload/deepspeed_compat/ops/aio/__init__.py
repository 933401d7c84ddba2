"""``deepspeed.ops.aio``: the capability probe scripts run before asking for NVMe offload.
``AsyncIOBuilder().is_compatible()`` is true: this project's NVMe offload has its own I/O
(the compiled module where built, a thread pool otherwise). DeepSpeed's raw I/O handle
(``load()``) is not provided."""

from __future__ import annotations

from ..._common import DeepSpeedNotProvidedError, not_provided_getattr


class AsyncIOBuilder:
    """DeepSpeed's op builder for its async I/O, as a probe only."""

    NAME = "async_io"

    def is_compatible(self, verbose: bool = False) -> bool:
        """NVMe offload (``offload_optimizer`` / ``offload_param`` ``device: "nvme"``) works."""
        return True

    def load(self, verbose: bool = True):
        raise DeepSpeedNotProvidedError(
            "deepspeed.ops.aio.AsyncIOBuilder().load()",
            " (DeepSpeed's raw aio handle; NVMe offload itself is configured with "
            'offload_optimizer/offload_param device "nvme")',
        )


__all__ = ["AsyncIOBuilder"]
__getattr__ = not_provided_getattr(__name__)
