"""``deepspeed.runtime.zero.utils``: DeepSpeed's ZeRO runtime exception class."""

from ..._common import not_provided_getattr


class ZeRORuntimeException(Exception):
    """DeepSpeed's ZeRO runtime error class (``deepspeed.runtime.zero.utils``)."""


__all__ = ["ZeRORuntimeException"]
__getattr__ = not_provided_getattr(__name__)
