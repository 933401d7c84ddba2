"""The engine assembled from the config and the placement: the only code that reads the config
to build components (settings, the module prepared, flat groups, NVMe preflight, the stage-3
param store, one ``OptimizerGroup`` per param group, the reducer and fetch schedule, the step's
policies). The components receive typed parts of it, never the config.
"""

from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING

import torch

from ...activation_checkpointing import CheckpointPolicy, configure_from_engine
from ...config.auto_sizes import resolve_auto_sizes
from ...config.runtime_keys import DTYPES
from ...core import dist
from ...core.consistency import synchronize_start
from ...core.flat_group import FlatGroup
from ...core.shard_state import ShardState
from ...core.streams import Streams
from ...nvme.aio import AioEngine
from ...utils.z3_leaf_module import apply_leaf_config
from ..backward_scope import BackwardScope
from ..reduce.grad_shard import GradShard
from ..reduce.reducer import Reducer
from ..stage3.fetch_schedule import FetchSchedule
from ..stage3.init_partition import materialize
from ..stage3.memory_efficient_linear import attach as attach_linear
from ..stage3.param_store import ParamStore, ShardHome, Stage3Policy
from ..stage3.partition_units import move_buffers, unit_ids, unit_layout
from ..update.group import OptimizerGroup, build_shard_optimizer
from ..update.host_worker import HostWorker
from ..update.momentum_state import MomentumState
from ..update.param_home import FlatHome, ParamHome
from ..update.placement import Placement, run_name
from ..update.shard_optimizer import UpdatePolicy
from ..update.state_build import alias_state, build_nvme_params, build_states, preflight
from ..update.zero_optimizer import ZeroOptimizer
from ..zenflow.wiring import build_zenflow_update, zenflow_schedule
from . import guards
from .autocast import AutocastPolicy, grad_scaler_for_fp16
from .keep_in_fp32 import keep_pattern, kept_buffers
from .loss_scaler import build_loss_scaler
from .memory_model import ZeroPlan
from .module_cast import cast_buffers_, cast_params_
from .overflow import OverflowMonitor
from .pin_warning import unpinned_keys, warn_unpinned
from .window import Window

if TYPE_CHECKING:
    from .engine import ZeroOffloadEngine


def assemble(
    e: ZeroOffloadEngine,
    module: torch.nn.Module,
    config,
    param_groups: list[dict],
    adamw: bool,
    lr_scheduler=None,
    training_dataloader=None,
    client: torch.optim.Optimizer | None = None,
) -> None:
    """The assembly, in order: settings and counters; the module on the device and equal on
    every rank; the flat groups; the NVMe preflight (before anything is partitioned); the
    stage-3 param store; per group the grad shard, param home, optimizer state and shard
    optimizer; the reducer and the fetch schedule; the step's policies."""
    read_settings(e, module, config, lr_scheduler, training_dataloader)
    prepare_module(e)
    flat, store_groups = build_groups(e, param_groups)
    preflight(e.placement, flat, store_groups, e.stage >= 1, client, e.device)
    build_store(e, flat, store_groups)
    e.opt_groups = build_updates(e, flat, adamw, client)
    build_reducer(e)
    build_step_policies(e)


def read_settings(e: ZeroOffloadEngine, module, config, lr_scheduler, training_dataloader) -> None:
    """What the components are built from; the counters at zero."""
    e.destroyed = False
    guards.take_over(module.parameters())
    # Params that require grad now but are left out of the optimizer on purpose (a subset
    # in model_parameters) are allowed; any other trainable param at a step is an error.
    e._known_params = {id(p) for p in module.parameters() if p.requires_grad}
    config, _ = resolve_auto_sizes(config, module)  # "auto" sizes from the hidden size
    e.module, e.config = module, config
    e.lr_scheduler, e.training_dataloader = lr_scheduler, training_dataloader
    e.device = dist.default_device()
    if e.device.type == "cuda":  # streams, events and collectives act on the current one
        torch.cuda.set_device(e.device)
    e.dtype = config.dtype
    e.autocast = AutocastPolicy.from_config(config.torch_autocast, e.device)
    # DeepSpeed's activation_checkpointing section: applied to the process-wide checkpointing
    # API unless the script configured it first (deepspeed.checkpointing.configure wins).
    e.checkpoint_policy = CheckpointPolicy.from_section(config.activation_checkpointing)
    if e.checkpoint_policy != CheckpointPolicy():
        configure_from_engine(e.checkpoint_policy)
    accum = config.data_types.grad_accum_dtype  # stages 0/1: only fp32 with bf16 (config)
    e.grad_accum_dtype = DTYPES[accum] if accum is not None else e.dtype
    e.world_size, e.global_rank = dist.world_size(), dist.rank()
    e.local_rank = dist.local_rank()
    zc = config.zero_optimization
    e.stage = zc.stage
    # expected_memory's input (pinned host buffers counted as held on CUDA)
    e.zero_plan = ZeroPlan.from_config(config, e.world_size, e.device)
    e.placement = Placement.from_config(config, e.device, e.global_rank, run_name())
    warn_unpinned(e.device, unpinned_keys(zc))
    nvme = e.placement.nvme
    e.aio = AioEngine(nvme.aio) if nvme is not None else None
    # managed false: backward() only accumulates; each step() ends the window and updates.
    e.window = Window(
        config.gradient_accumulation_steps, bool(config.managed_gradient_accumulation)
    )
    e.global_steps = e.global_samples = e.micro_steps = e.skipped_steps = 0
    e._grad_norm = None
    e._report_grad_norm = bool(zc.compute_grad_norm)  # false: get_global_grad_norm() is None
    e._holds_python_gc = False  # taken once the engine is built, released by destroy()
    e._python_gc_off = bool(config.disable_python_gc)
    e._loss_scaled = False  # engine.scale(loss) was called since the last backward
    e._linears = []
    e.param_store = None
    e.fetch_schedule = None


def prepare_module(e: ZeroOffloadEngine) -> None:
    """Stages 0-2: params on the device in the training dtype; stage 3: buffers only (params
    are partitioned from wherever they are, one at a time). Then every rank holds rank 0's
    weights and the same config."""
    module = e.module
    guards.check_materialized(module)
    e.autocast.mark_params(module, e.config.torch_autocast.lower_precision_safe_modules)
    if e.stage == 3:
        move_buffers(module, e.device)
        apply_leaf_config(module, e.config.zero_optimization.leaf_module)  # before units
    else:
        for p in module.parameters():
            materialize(p)
        cast_params_(module, e.device, e.dtype)  # buffers keep their own dtype
    data_types = e.config.data_types
    kept = kept_buffers(module, keep_pattern(module, data_types.keep_in_fp32_modules, e.dtype))
    if data_types.buffer_dtype is not None:  # DeepSpeed's data_types.buffer_dtype
        cast_buffers_(module, DTYPES[data_types.buffer_dtype], kept)
    synchronize_start(module, e.config)  # before any layout
    e.streams = Streams(e.device)
    e._executor = HostWorker(e.device, e.placement.threads) if e.placement.delayed else None


def build_groups(
    e: ZeroOffloadEngine, param_groups: list[dict]
) -> tuple[list[FlatGroup], list[FlatGroup] | None]:
    """One flat group per optimizer param group (its ``hyper`` is the caller's dict itself,
    so a scheduler writing its "lr" reaches the update); stage 3: laid out one bucket per
    fetch unit, with the store's groups (those plus one for every other param)."""
    module, zc, partitioned = e.module, e.config.zero_optimization, e.stage == 3
    names = {id(p): n for n, p in module.named_parameters()}
    order = {id(p): i for i, (_, p) in enumerate(module.named_parameters())}
    n_total = len(order)
    e._flat_positions = {pid: n_total - 1 - i for pid, i in order.items()}
    units = unit_ids(module) if partitioned else None

    def group(gi: int, params: list, hyper: dict) -> FlatGroup:
        params = sorted(params, key=lambda p: order.get(id(p), n_total))
        return FlatGroup(
            gi,
            params,
            [names.get(id(p), f"group{gi}.{i}") for i, p in enumerate(params)],
            hyper,
            e.dtype,
            e.device,
            e.world_size,
            e.global_rank,
            int(zc.reduce_bucket_size),
            layout=unit_layout(params, units, e.world_size) if partitioned else None,
            materialize=not partitioned,
        )

    groups = [group(gi, pg["params"], pg) for gi, pg in enumerate(param_groups)]
    if not partitioned:
        return groups, None
    trained = {id(p) for g in groups for p in g.params}
    rest = [
        p
        for p in dict.fromkeys(module.parameters())
        if id(p) not in trained and (p.is_floating_point() or hasattr(p, "_z3_init"))
    ]
    return groups, groups + ([group(len(groups), rest, {})] if rest else [])


def build_store(
    e: ZeroOffloadEngine, groups: list[FlatGroup], store_groups: list[FlatGroup] | None
) -> None:
    """Stage 3: every param partitioned into the store (device, host or NVMe shards)."""
    if store_groups is None:
        return
    zc = e.config.zero_optimization
    if zc.memory_efficient_linear:
        e._linears = attach_linear(e.module)
    e.param_store = ParamStore(
        store_groups,
        [g in groups for g in store_groups],
        Stage3Policy.from_config(zc, e.placement.params),
        e.streams,
        e.device,
        build_nvme_params(e.placement, e.aio),
    )


def build_reducer(e: ZeroOffloadEngine) -> None:
    """The gradient path (hooks, buckets, collectives) and, at stage 3, the fetch schedule
    (after the reducer: its hooks read a gradient before a slot is released)."""
    zc = e.config.zero_optimization
    e.scope = BackwardScope(e._backward_prologue)
    e.reducer = Reducer(
        e.groups,
        e.grad_shards,
        min(e.stage, 2),
        bool(zc.overlap_comm),
        bool(zc.reduce_scatter),
        e.streams,
        e._flat_positions,
        e.scope,
        ignore_unused=bool(zc.ignore_unused_parameters),
        average=e.config.gradient_allreduce_op == "mean",
        bucket_size=int(zc.reduce_bucket_size),
    )
    if e.param_store is not None:
        e.fetch_schedule = FetchSchedule(e.param_store, e.module, e.param_store.policy, e.scope)
        e.param_store.settle = e._before_param_edit
    e.scope.on_end(e._backward_epilogue, lambda: None)  # after the components' ends
    if not e.window.managed:
        for gs in e.grad_shards:
            gs.ensure_device_accumulator()


def build_step_policies(e: ZeroOffloadEngine) -> None:
    """The optimizer users see, loss scaling, overflow handling, clipping, reporting."""
    config = e.config
    e.optimizer = ZeroOptimizer(e.groups, e.shard_opts) if e.groups else None
    # fp16 autocast (fp16 section off) scales the loss as torch's GradScaler does, as DeepSpeed
    scaled = config.fp16.enabled or e.autocast.scales_loss
    if config.fp16.enabled or not scaled:
        e.loss_scaler = build_loss_scaler(config.fp16 if config.fp16.enabled else None)
    else:
        e.loss_scaler = grad_scaler_for_fp16(float(config.fp16.min_loss_scale))
    e._overflows = OverflowMonitor(
        e.loss_scaler.dynamic,
        float(config.fp16.min_loss_scale),
        int(config.max_consecutive_overflows),
        e.global_rank,
    )
    e.clip = float(config.gradient_clipping)
    e._fp16 = bool(scaled)  # a plain backward needs engine.scale(loss)
    e._print_every = config.steps_per_print
    e._micro_batch = int(config.train_micro_batch_size_per_gpu)
    e._t_step = time.perf_counter()
    e.wall_clock = bool(config.wall_clock_breakdown)
    e._times: dict[str, float] = {}


def build_updates(
    e: ZeroOffloadEngine, groups: list[FlatGroup], adamw: bool, client: torch.optim.Optimizer | None
) -> list[OptimizerGroup]:
    """Per trainable group: its grad shard, its param home, its optimizer state (placed by
    ``e.placement``) and the shard optimizer that updates them, as one object."""
    place = e.placement
    sharded = e.stage >= 1
    e.zenflow = zenflow_for(e, groups, client)
    homes = [_param_home(e, g, gi, sharded) for gi, g in enumerate(groups)]
    states = _states(e, groups, homes, sharded, client)
    policy = UpdatePolicy(sharded, adamw, place)
    out = []
    for gi, (g, home, state) in enumerate(zip(groups, homes, states)):
        gs = GradShard(
            g,
            min(e.stage, 2),  # stage 3 reduces gradients exactly as stage 2
            place.host_update,
            e.window.gas,
            e.streams,
            place.pin,
            host_buffers=2 if place.delayed else 1,
            accum_dtype=e.grad_accum_dtype,
            host_from=place.host_from(g.shard_numel(sharded)),
        )
        args = (g, gs, home, state, policy, e.streams)
        if e.zenflow is not None:
            clip = float(e.config.gradient_clipping)
            so = build_zenflow_update(args, e.zenflow, clip, lambda: e.loss_scaler.loss_scale)
        else:
            so = build_shard_optimizer(*args, e._executor, client)
        if e.stage == 3:
            e.param_store.masters[gi] = so.state
        for i, p in enumerate(g.params):
            p._zero_offload = (weakref.ref(e), gi, i)
        out.append(OptimizerGroup(g, gs, home, so, place))
    return out


def zenflow_for(e: ZeroOffloadEngine, groups: list[FlatGroup], client) -> object:
    """``zero_optimization.zenflow``'s schedule where it is built (every step() is then one
    ZenFlow micro-step: the window is one backward), else None."""
    params = [p for g in groups for p in g.params]
    dl = e.training_dataloader
    steps = len(dl) if dl is not None and hasattr(dl, "__len__") else None
    muon = any(g.hyper.get("use_muon") for g in groups)
    schedule = zenflow_schedule(e.config, e.world_size, params, client or muon or None, steps)
    if schedule is not None:
        e.window.gas = 1
    return schedule


def _param_home(e: ZeroOffloadEngine, g: FlatGroup, gi: int, sharded: bool) -> ParamHome:
    if e.stage == 3:
        return ShardHome(e.param_store, gi)
    zc = e.config.zero_optimization
    return FlatHome(
        g, e.streams, sharded, int(zc.allgather_bucket_size), bool(zc.allgather_partitions)
    )


def _states(e, groups, homes, sharded: bool, client) -> list[ShardState]:
    """Each group's optimizer state: the params themselves as the master where that holds
    (fp32 on the device, ``alias_state``), else a master of its own where the placement says;
    a Muon group's is that master with one momentum buffer instead of Adam's moments."""
    muon = {g.index for g in groups if g.hyper.get("use_muon")}
    adam = client is None
    aliases = [
        alias_state(g, h, sharded, e.placement, client, adam and g.index not in muon)
        for g, h in zip(groups, homes)
    ]
    rest = [g for g, a in zip(groups, aliases) if a is None]
    built: dict[int, ShardState] = {}
    for is_muon in (False, True):  # Adam's moments (unless a client's), or none for Muon
        part = [g for g in rest if (g.index in muon) == is_muon]
        made = build_states(part, sharded, e.placement, e.aio, adam and not is_muon)
        built.update(zip([g.index for g in part], made))
    states = [a if a is not None else built[g.index] for g, a in zip(groups, aliases)]
    return [MomentumState(s) if g.index in muon else s for g, s in zip(groups, states)]
