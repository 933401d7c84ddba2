"""What the assembly builds and the engine runs: ``EngineParts``, the engine's fixed fields, and
``EngineHooks``, the engine's methods the components call back.

The assembly (``assembly.py``) reads the config once and returns one ``EngineParts``; the engine
takes every field of it under the same name and never writes one of them again. Neither module
imports the other's class: the engine calls ``assemble`` with its hooks, the assembly knows only
the hooks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ...activation_checkpointing import CheckpointPolicy
from ...core.streams import Streams
from ...nvme.io.aio import AioEngine
from ..backward_scope import BackwardScope
from ..plan.memory_model import ZeroPlan
from ..precision.autocast import AutocastPolicy
from ..precision.overflow import OverflowMonitor
from ..reduce.reducer import Reducer
from ..stage3.fetch_schedule import FetchSchedule
from ..stage3.param_store import ParamStore
from ..update.group import OptimizerGroup
from ..update.paths.host_worker import HostWorker
from ..update.placement import Placement
from .deepspeed_api.zero_optimizer import ZeroOptimizer
from .window import Window


@dataclass(frozen=True)
class EngineHooks:
    """The engine's methods its components call: the backward's start and end (the backward
    scope), and the step before a stage-3 param edit (the param store)."""

    backward_prologue: Callable[[str], None]
    backward_epilogue: Callable[[], None]
    before_param_edit: Callable[[], None]


@dataclass
class EngineParts:
    """Everything the engine runs, built from the config. Fields, in the assembly's order:"""

    # ---- settings and the module
    module: torch.nn.Module
    config: Any  # the validated ``ZeroOffloadConfig``, "auto" sizes resolved
    lr_scheduler: Any
    training_dataloader: Any
    device: torch.device
    dtype: torch.dtype  # the training dtype of the model params
    grad_accum_dtype: torch.dtype  # the gradient shards' dtype
    autocast: AutocastPolicy
    checkpoint_policy: CheckpointPolicy
    world_size: int
    global_rank: int
    local_rank: int
    stage: int
    zero_plan: ZeroPlan  # ``expected_memory``'s input
    placement: Placement
    window: Window  # the accumulation window
    known_params: set[int]  # ids of the params trainable at build time (check_trained)
    # ---- the components
    streams: Streams
    aio: AioEngine | None  # NVMe placement only
    executor: HostWorker | None  # the delayed update's worker
    linears: list  # stage 3's memory-efficient linears, detached by destroy()
    param_store: ParamStore | None  # stage 3
    fetch_schedule: FetchSchedule | None  # stage 3
    opt_groups: list[OptimizerGroup]  # one per optimizer param group, by its index
    scope: BackwardScope
    reducer: Reducer
    # ---- the step's policies
    optimizer: ZeroOptimizer | None  # None: no optimizer (forward only)
    loss_scaler: Any  # none, static or dynamic (``loss_scaler.py``), or autocast's GradScaler
    overflows: OverflowMonitor
    clip: float  # gradient_clipping (0: none)
    fp16: bool  # the loss is scaled: a plain backward needs engine.scale(loss)
    print_every: int  # steps_per_print
    micro_batch: int  # train_micro_batch_size_per_gpu
    wall_clock: bool  # wall_clock_breakdown
    report_grad_norm: bool  # compute_grad_norm (false: get_global_grad_norm() is None)
    python_gc_off: bool  # disable_python_gc
