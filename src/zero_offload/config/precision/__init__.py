"""The training dtype: ``fp16`` and ``bf16`` (``fp16_bf16.py``, with fp16's loss scaling) and
``torch_autocast`` (``torch_autocast.py``: fp32 params, the forward under ``torch.autocast``)."""

from .fp16_bf16 import BF16Config, FP16Config
from .torch_autocast import TorchAutocastConfig

__all__ = ["BF16Config", "FP16Config", "TorchAutocastConfig"]
