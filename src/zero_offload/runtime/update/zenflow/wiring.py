"""Whether this engine runs ZenFlow, and its group update.

What is built: stages 1, 2 and 3, any number of ranks, a fixed ``update_interval`` (``overlap_step``
either way) or "auto", the built-in Adam(W), ``offload_optimizer`` "cpu".
What DeepSpeed 0.19.8 refuses or cannot run with ZenFlow is refused here, naming the key: the
delayed update and a partial ratio (at load, ``check_zenflow``), a client optimizer and params
of more than 2 dimensions (at initialize, ``refuse_model``). Any other ZenFlow config is not
built: it trains as plain ZeRO-Offload, with a warning naming what is missing (never silently).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ....config.zero.zenflow import ZenFlowSchedule, resolve_schedule
from ....core.partitioned import shape_of

log = logging.getLogger("zero_offload")

KEY = "zero_optimization.zenflow"


def unbuilt(config, world_size: int, muon: bool = False) -> str | None:
    """What of this config is not built (None: ZenFlow runs); the memory plan asks it too."""
    reasons = [(muon, "the Muon optimizer")]
    missing = [why for bad, why in reasons if bad]
    return ", ".join(missing) if missing else None


@dataclass(frozen=True)
class ZenFlowModel:
    """What the engine's groups say about the model: the trainable params (flat order), their
    names, the client optimizer (None: the config's) and whether Muon runs any group."""

    params: list[torch.Tensor]
    names: list[str]
    client: object = None
    muon: bool = False


def refuse_model(model: ZenFlowModel) -> None:
    """What DeepSpeed 0.19.8's ZenFlow cannot run, refused at initialize: a client optimizer
    (its ZeRO-Offload refuses one; allowed, its ZenFlow fails building the device optimizer)
    and params of more than 2 dimensions (its first selection fails on them, at every stage)."""
    if model.client is not None:
        raise ValueError(
            f"{KEY}: needs the config's optimizer (Adam or AdamW, optimizer.type); a client "
            f"optimizer ({type(model.client).__name__}) cannot run ZenFlow's device and host parts"
        )
    for p, name in zip(model.params, model.names):
        if len(shape_of(p)) > 2:
            raise ValueError(
                f"{KEY}: params of at most 2 dimensions (columns are ranked per 2-D param); "
                f"{name} has shape {shape_of(p)}: remove zenflow or keep such params out of "
                "the optimizer"
            )


def zenflow_schedule(
    config, world_size: int, model: ZenFlowModel, steps_per_epoch: int | None
) -> ZenFlowSchedule | None:
    """The resolved schedule, or None: ZenFlow is off, or not built for this config (warned)."""
    zf = config.zero_optimization.zenflow
    if zf is None:
        return None
    schedule = resolve_schedule(zf, steps_per_epoch)  # refusals first, built or not
    refuse_model(model)
    why = unbuilt(config, world_size, model.muon)
    if why is not None:
        log.warning(
            "%s: not built for %s; this run trains plain ZeRO-Offload Adam, not ZenFlow", KEY, why
        )
        return None
    return schedule


def auto_rule(schedule: ZenFlowSchedule, params: list[torch.Tensor]):
    """The engine's one "auto" rule (shared by its groups), or None: a fixed interval."""
    from .auto_interval import AutoInterval

    if not schedule.auto_update:
        return None
    return AutoInterval(schedule, sum(1 for p in params if len(shape_of(p)) == 2))


def build_zenflow_update(
    args: tuple,
    schedule: ZenFlowSchedule,
    clip: float,
    loss_scale: Callable[[], float],
    auto=None,
    worker=None,
):
    """The group's update: ``args`` are ``build_shard_optimizer``'s (group, grads, home, state,
    policy, streams); ``loss_scale`` is read at each micro-step (fp16's changes); ``auto``:
    ``auto_rule``'s object; ``worker``: the engine's host-update worker (``overlap_step``)."""
    from ..paths.host_update import HostUpdate
    from .overlap import ZenFlowOverlapRunner
    from .update import ZenFlowRunner

    kw = dict(schedule=schedule, clip=clip, loss_scale=loss_scale, auto=auto)
    runner = (
        ZenFlowOverlapRunner(worker=worker, **kw) if schedule.overlap_step else ZenFlowRunner(**kw)
    )
    return HostUpdate(*args, runner=runner)
