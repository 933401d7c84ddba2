"""``optimizer`` and ``scheduler``: the optimizer and its params (``optimizer.py``, with Muon's
split between its own group and the AdamW aux group in ``muon_params.py``) and the learning-rate
schedule (``scheduler.py``)."""

from .optimizer import AdamParams, OptimizerConfig
from .scheduler import SchedulerConfig

__all__ = ["AdamParams", "OptimizerConfig", "SchedulerConfig"]
