"""DeepSpeed's per-param gather status (``p.ds_status``) for partitioned (stage 3) params."""

from __future__ import annotations

import enum


class ZeroParamStatus(enum.Enum):
    AVAILABLE = 1  # full data bound to the param
    NOT_AVAILABLE = 2  # only this rank's shard exists; p.numel() == 0
    INFLIGHT = 3  # an all-gather is under way
