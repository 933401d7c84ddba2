"""The engine assembled from the config and the placement: the only code that reads the config
to build components (settings, the module prepared, flat groups, NVMe preflight, the stage-3
param store, one ``OptimizerGroup`` per param group, the reducer and fetch schedule, the step's
policies). The components receive typed parts of it, never the config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ...activation_checkpointing import CheckpointPolicy, configure_from_engine
from ...config.loading.auto_sizes import resolve_auto_sizes
from ...config.runtime_keys import DTYPES
from ...config.zero.zenflow import ZenFlowSchedule
from ...core import dist, host_heap, partitioned
from ...core.consistency import synchronize_start
from ...core.flat_group import FlatGroup
from ...core.state.shard_state import ShardState
from ...core.streams import Streams
from ...nvme.io.aio import AioEngine
from ...utils.z3_leaf_module import apply_leaf_config
from ..backward_scope import BackwardScope
from ..plan.memory_model import ZeroPlan
from ..precision.autocast import AutocastPolicy, grad_scaler_for_fp16
from ..precision.loss_scaler import build_loss_scaler
from ..precision.overflow import OverflowMonitor
from ..reduce.grad_shard import GradShard
from ..reduce.reducer import Reducer
from ..stage3.fetch_schedule import FetchSchedule
from ..stage3.init_partition import materialize
from ..stage3.memory_efficient_linear import attach as attach_linear
from ..stage3.param_store import ParamStore, ShardHome, Stage3Policy
from ..stage3.partition_units import move_buffers, unit_ids, unit_layout
from ..update.group import OptimizerGroup, build_shard_optimizer
from ..update.muon.momentum_state import MomentumState
from ..update.param_home import FlatHome, ParamHome
from ..update.paths.host_worker import HostWorker
from ..update.placement import Placement, run_name
from ..update.shard_optimizer import UpdatePolicy
from ..update.state_build import alias_state, build_nvme_params, build_states, preflight
from ..update.zenflow.wiring import (
    ZenFlowModel,
    auto_rule,
    build_zenflow_update,
    zenflow_schedule,
)
from . import guards
from .deepspeed_api.zero_optimizer import ZeroOptimizer
from .keep_in_fp32 import keep_pattern, kept_buffers
from .module_cast import cast_buffers_, cast_params_
from .parts import EngineHooks, EngineParts
from .pin_warning import unpinned_keys, warn_unpinned
from .window import Window


@dataclass
class _Building:
    """The parts as the assembly fills them in, step by step (``EngineParts`` once complete)."""

    hooks: EngineHooks
    fields: dict = field(default_factory=dict)
    flat_positions: dict[int, int] = field(default_factory=dict)  # the reducer's param order

    if TYPE_CHECKING:  # fields ``set`` fills in, typed for the type checker

        @property
        def stage(self) -> int: ...
        @property
        def module(self) -> torch.nn.Module: ...
        @property
        def world_size(self) -> int: ...
        @property
        def global_rank(self) -> int: ...
        @property
        def device(self) -> torch.device: ...
        @property
        def dtype(self) -> torch.dtype: ...

    def __getattr__(self, name: str):
        try:
            return self.__dict__["fields"][name]
        except KeyError:
            raise AttributeError(name) from None

    def set(self, **kw) -> None:
        self.fields.update(kw)


def assemble(
    hooks: EngineHooks,
    module: torch.nn.Module,
    config,
    param_groups: list[dict],
    adamw: bool,
    lr_scheduler=None,
    training_dataloader=None,
    client: torch.optim.Optimizer | None = None,
) -> EngineParts:
    """The assembly, in order: settings; the module on the device and equal on every rank; the
    flat groups; the NVMe preflight (before anything is partitioned); the stage-3 param store;
    per group the grad shard, param home, optimizer state and shard optimizer; the reducer and
    the fetch schedule; the step's policies. ``hooks``: the engine's methods the components
    call back."""
    if config.zero_optimization.uses_nvme:  # disk-bound steps: large blocks not kept freed,
        host_heap.fix_mmap_threshold()  # set before the model's first allocation here
    e = _Building(hooks)
    read_settings(e, module, config, lr_scheduler, training_dataloader)
    prepare_module(e)
    flat, store_groups = build_groups(e, param_groups)
    preflight(e.placement, flat, store_groups, e.stage >= 1, client, e.device)
    build_store(e, flat, store_groups)
    e.set(opt_groups=build_updates(e, flat, adamw, client))
    build_reducer(e)
    build_step_policies(e)
    return EngineParts(**e.fields)


def read_settings(e: _Building, module, config, lr_scheduler, training_dataloader) -> None:
    """What the components are built from."""
    guards.take_over(module.parameters())
    # Params that require grad now but are left out of the optimizer on purpose (a subset
    # in model_parameters) are allowed; any other trainable param at a step is an error.
    known = {id(p) for p in module.parameters() if p.requires_grad}
    config, _ = resolve_auto_sizes(config, module)  # "auto" sizes from the hidden size
    device = dist.default_device()
    if device.type == "cuda":  # streams, events and collectives act on the current one
        torch.cuda.set_device(device)
    # DeepSpeed's activation_checkpointing section: applied to the process-wide checkpointing
    # API unless the script configured it first (deepspeed.checkpointing.configure wins).
    policy = CheckpointPolicy.from_section(config.activation_checkpointing)
    if policy != CheckpointPolicy():
        configure_from_engine(policy)
    accum = config.data_types.grad_accum_dtype  # stages 0/1: only fp32 with bf16 (config)
    world_size, rank = dist.world_size(), dist.rank()
    zc = config.zero_optimization
    placement = Placement.from_config(config, device, rank, run_name())
    warn_unpinned(device, unpinned_keys(zc))
    nvme = placement.nvme
    e.set(
        module=module,
        config=config,
        lr_scheduler=lr_scheduler,
        training_dataloader=training_dataloader,
        device=device,
        dtype=config.dtype,
        grad_accum_dtype=DTYPES[accum] if accum is not None else config.dtype,
        autocast=AutocastPolicy.from_config(config.torch_autocast, device),
        checkpoint_policy=policy,
        world_size=world_size,
        global_rank=rank,
        local_rank=dist.local_rank(),
        stage=zc.stage,
        # expected_memory's input (pinned host buffers counted as held on CUDA)
        zero_plan=ZeroPlan.from_config(config, world_size, device),
        placement=placement,
        # managed false: backward() only accumulates; each step() ends the window and updates.
        window=Window(
            config.gradient_accumulation_steps, bool(config.managed_gradient_accumulation)
        ),
        known_params=known,
        aio=AioEngine(nvme.aio) if nvme is not None else None,
        linears=[],
        param_store=None,
        fetch_schedule=None,
    )


def prepare_module(e: _Building) -> None:
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
    e.set(
        streams=Streams(e.device),
        executor=HostWorker(e.device, e.placement.threads) if e.placement.delayed else None,
    )


def build_groups(
    e: _Building, param_groups: list[dict]
) -> tuple[list[FlatGroup], list[FlatGroup] | None]:
    """One flat group per optimizer param group (its ``hyper`` is the caller's dict itself,
    so a scheduler writing its "lr" reaches the update); stage 3: laid out one bucket per
    fetch unit, with the store's groups (those plus one for every other param)."""
    module, zc, stage3 = e.module, e.config.zero_optimization, e.stage == 3
    names = {id(p): n for n, p in module.named_parameters()}
    order = {id(p): i for i, (_, p) in enumerate(module.named_parameters())}
    n_total = len(order)
    e.flat_positions = {pid: n_total - 1 - i for pid, i in order.items()}
    units = unit_ids(module) if stage3 else None

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
            layout=unit_layout(params, units, e.world_size) if stage3 else None,
            materialize=not stage3,
        )

    groups = [group(gi, pg["params"], pg) for gi, pg in enumerate(param_groups)]
    if not stage3:
        return groups, None
    trained = {id(p) for g in groups for p in g.params}
    rest = [
        p
        for p in dict.fromkeys(module.parameters())
        if id(p) not in trained and (p.is_floating_point() or partitioned.init_shard(p) is not None)
    ]
    return groups, groups + ([group(len(groups), rest, {})] if rest else [])


def build_store(
    e: _Building, groups: list[FlatGroup], store_groups: list[FlatGroup] | None
) -> None:
    """Stage 3: every param partitioned into the store (device, host or NVMe shards)."""
    if store_groups is None:
        return
    zc = e.config.zero_optimization
    if zc.memory_efficient_linear:
        e.set(linears=attach_linear(e.module))
    store = ParamStore(
        store_groups,
        [g in groups for g in store_groups],
        Stage3Policy.from_config(zc, e.placement.params),
        e.streams,
        e.device,
        build_nvme_params(e.placement, e.aio),
    )
    e.set(param_store=store)


def build_reducer(e: _Building) -> None:
    """The gradient path (hooks, buckets, collectives) and, at stage 3, the fetch schedule
    (after the reducer: its hooks read a gradient before a slot is released)."""
    zc = e.config.zero_optimization
    scope = BackwardScope(e.hooks.backward_prologue)
    groups = e.opt_groups
    reducer = Reducer(
        [og.flat for og in groups],
        [og.grads for og in groups],
        min(e.stage, 2),
        bool(zc.overlap_comm),
        bool(zc.reduce_scatter),
        e.streams,
        e.flat_positions,
        scope,
        ignore_unused=bool(zc.ignore_unused_parameters),
        average=e.config.gradient_allreduce_op == "mean",
        bucket_size=int(zc.reduce_bucket_size),
    )
    store = e.param_store
    if store is not None:
        e.set(fetch_schedule=FetchSchedule(store, e.module, store.policy, scope))
        store.settle = e.hooks.before_param_edit
    scope.on_end(e.hooks.backward_epilogue, lambda: None)  # after the components' ends
    if not e.window.managed:
        for og in groups:
            og.grads.ensure_device_accumulator()
    e.set(scope=scope, reducer=reducer)


def build_step_policies(e: _Building) -> None:
    """The optimizer users see, loss scaling, overflow handling, clipping, reporting."""
    config = e.config
    groups = e.opt_groups
    optimizer = (
        ZeroOptimizer([og.flat for og in groups], [og.optimizer for og in groups])
        if groups
        else None
    )
    # fp16 autocast (fp16 section off) scales the loss as torch's GradScaler does, as DeepSpeed
    scaled = config.fp16.enabled or e.autocast.scales_loss
    if config.fp16.enabled or not scaled:
        scaler = build_loss_scaler(config.fp16 if config.fp16.enabled else None)
    else:
        scaler = grad_scaler_for_fp16(float(config.fp16.min_loss_scale))
    overflows = OverflowMonitor(
        scaler.dynamic,
        float(config.fp16.min_loss_scale),
        int(config.max_consecutive_overflows),
        e.global_rank,
    )
    e.set(
        optimizer=optimizer,
        loss_scaler=scaler,
        overflows=overflows,
        clip=float(config.gradient_clipping),
        fp16=bool(scaled),
        print_every=config.steps_per_print,
        micro_batch=int(config.train_micro_batch_size_per_gpu),
        wall_clock=bool(config.wall_clock_breakdown),
        report_grad_norm=bool(config.zero_optimization.compute_grad_norm),
        python_gc_off=bool(config.disable_python_gc),
    )


def build_updates(
    e: _Building, groups: list[FlatGroup], adamw: bool, client: torch.optim.Optimizer | None
) -> list[OptimizerGroup]:
    """Per trainable group: its grad shard, its param home, its optimizer state (placed by
    ``e.placement``) and the shard optimizer that updates them, as one object."""
    place = e.placement
    sharded = e.stage >= 1
    zenflow = zenflow_for(e, groups, client)  # its schedule, or None
    homes = [_param_home(e, g, gi, sharded) for gi, g in enumerate(groups)]
    # ZenFlow keeps the master apart from the params: its overlapped host update writes the
    # master while the next steps read the params, and its device part writes params only
    states = _states(e, groups, homes, sharded, client, alias=zenflow is None)
    policy = UpdatePolicy(sharded, adamw, place)
    auto = None if zenflow is None else auto_rule(zenflow, [p for g in groups for p in g.params])
    if zenflow is not None and zenflow.overlap_step and e.executor is None:
        # the engine's one host-update worker: the groups' overlapped updates run one after
        # another with the kernel's threads, and destroy() joins it
        e.set(executor=HostWorker(e.device, place.threads))
    out = []
    for g, home, state in zip(groups, homes, states):
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
        if zenflow is not None:
            clip = float(e.config.gradient_clipping)
            scale = lambda: e.loss_scaler.loss_scale  # noqa: E731
            so = build_zenflow_update(args, zenflow, clip, scale, auto, e.executor)
        else:
            so = build_shard_optimizer(*args, e.executor, client)
        out.append(OptimizerGroup(g, gs, home, so, place))
    if e.param_store is not None:  # a GatheredParameters edit reaches the master too
        e.param_store.edit_master = lambda gi, lo, src: out[gi].write_master(lo, src)
    return out


def zenflow_for(e: _Building, groups: list[FlatGroup], client) -> ZenFlowSchedule | None:
    """``zero_optimization.zenflow``'s schedule where it is built (every step() is then one
    ZenFlow micro-step: the window is one backward), else None."""
    params = [p for g in groups for p in g.params]
    dl = e.training_dataloader
    steps = len(dl) if dl is not None and hasattr(dl, "__len__") else None
    muon = any(g.hyper.get("use_muon") for g in groups)
    model = ZenFlowModel(params, [n for g in groups for n in g.names], client, muon)
    schedule = zenflow_schedule(e.config, e.world_size, model, steps)
    if schedule is not None:
        e.window.gas = 1
    elif e.zero_plan.zenflow is not None:  # not built for this model: no ZenFlow buffers
        e.set(zero_plan=dataclasses.replace(e.zero_plan, zenflow=None))
    return schedule


def _param_home(e: _Building, g: FlatGroup, gi: int, sharded: bool) -> ParamHome:
    if e.stage == 3:
        return ShardHome(e.param_store, gi)
    zc = e.config.zero_optimization
    return FlatHome(
        g, e.streams, sharded, int(zc.allgather_bucket_size), bool(zc.allgather_partitions)
    )


def _states(e, groups, homes, sharded: bool, client, alias: bool = True) -> list[ShardState]:
    """Each group's optimizer state: the params themselves as the master where that holds
    (fp32 on the device, ``alias_state``; ``alias`` False: never), else a master of its own
    where the placement says; a Muon group's is that master with one momentum buffer instead
    of Adam's moments."""
    muon = {g.index for g in groups if g.hyper.get("use_muon")}
    adam = client is None
    aliases = [
        alias_state(g, h, sharded, e.placement, client, adam and g.index not in muon)
        if alias
        else None
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
