"""Whether this engine runs ZenFlow, and its group update.

What is built: stages 1 and 2, any number of ranks, a fixed ``update_interval`` (``overlap_step`` either
way), the built-in Adam(W) over params of at most 2 dimensions, ``offload_optimizer`` "cpu" without
the delayed update or a partial ratio. Any other ZenFlow config is not built: it trains as plain
ZeRO-Offload, with a warning naming what is missing (never silently).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ....config.zero.zenflow import ZenFlowSchedule, resolve_schedule

log = logging.getLogger("zero_offload")

KEY = "zero_optimization.zenflow"


def unbuilt(config, world_size: int, params: list[torch.Tensor], client: object) -> str | None:
    """What of this config is not built (None: ZenFlow runs); the memory plan asks it too."""
    zc, zf = config.zero_optimization, config.zero_optimization.zenflow
    oc = zc.offload_optimizer
    reasons = [
        (zc.stage == 3, "stage 3"),
        (isinstance(zf.update_interval, str), 'update_interval "auto"'),
        (oc.delayed_update, "offload_optimizer.delayed_update"),
        (oc.ratio < 1.0, "offload_optimizer.ratio < 1"),
        (client is not None, "a client optimizer"),
        (any(p.dim() > 2 for p in params), "params of more than 2 dimensions"),
    ]
    missing = [why for bad, why in reasons if bad]
    return ", ".join(missing) if missing else None


def zenflow_schedule(
    config, world_size: int, params: list[torch.Tensor], client: object, steps_per_epoch
) -> ZenFlowSchedule | None:
    """The resolved schedule, or None: ZenFlow is off, or not built for this config (warned)."""
    zf = config.zero_optimization.zenflow
    if zf is None:
        return None
    schedule = resolve_schedule(zf, steps_per_epoch)  # refusals first, built or not
    why = unbuilt(config, world_size, params, client)
    if why is not None:
        log.warning(
            "%s: not built for %s; this run trains plain ZeRO-Offload Adam, not ZenFlow", KEY, why
        )
        return None
    return schedule


def build_zenflow_update(
    args: tuple, schedule: ZenFlowSchedule, clip: float, loss_scale: Callable[[], float]
):
    """The group's update: ``args`` are ``build_shard_optimizer``'s (group, grads, home, state,
    policy, streams); ``loss_scale`` is read at each host update (fp16's changes)."""
    from .overlap import ZenFlowOverlapUpdate
    from .update import ZenFlowUpdate

    cls = ZenFlowOverlapUpdate if schedule.overlap_step else ZenFlowUpdate
    return cls(*args, schedule=schedule, clip=clip, loss_scale=loss_scale)
