"""The engine: a thin orchestrator of the components, with DeepSpeed's engine API.

Built once from the validated config; the hot path (backward hooks, step) never re-reads it.
``engine(*inputs)`` runs the module, ``backward(loss)`` scales the loss (fp16 scale, 1/GAS) and
runs autograd while the reducer moves gradients out, ``step()`` updates at the accumulation
boundary only.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import math
import time
import weakref

import torch

from ..config.auto_sizes import resolve_auto_sizes
from ..config.runtime_keys import DTYPES
from ..nvme.aio import AioEngine
from ..nvme.errors import NvmeSwapError
from ..utils.z3_leaf_module import apply_leaf_config
from . import dist, guards
from .backward_scope import ENGINE, PLAIN, BackwardScope, in_backward
from .consistency import synchronize_start
from .engine_api import DeepSpeedEngineAPI
from .engine_compat import DeepSpeedCompatAPI
from .fetch_schedule import FetchSchedule
from .flat_group import FlatGroup
from .grad_shard import GradShard
from .init_partition import materialize
from .loss_scaler import build_loss_scaler
from .memory import expected_bytes
from .memory_bounds import check_working_set, free_bytes
from .memory_efficient_linear import attach as attach_linear
from .memory_efficient_linear import detach as detach_linear
from .memory_model import StepShape, ZeroPlan, predict
from .model_shape import ModelShape
from .module_cast import cast_params_
from .overflow import OverflowMonitor
from .param_home import FlatHome
from .param_store import ParamStore, ShardHome, Stage3Policy
from .partition_units import move_buffers, unit_ids, unit_layout
from .placement import Placement, run_name
from .reducer import Reducer
from .shard_optimizer import ShardOptimizer, UpdatePolicy
from .state_build import build_nvme_params, build_states, preflight
from .streams import Streams
from .zero_optimizer import ZeroOptimizer

log = logging.getLogger("zero_offload")


class ZeroOffloadEngine(DeepSpeedEngineAPI, DeepSpeedCompatAPI, torch.nn.Module):
    def __init__(
        self,
        module: torch.nn.Module,
        config,
        param_groups: list[dict],
        adamw: bool,
        lr_scheduler=None,
        training_dataloader=None,
        client: torch.optim.Optimizer | None = None,
    ) -> None:
        """``param_groups`` empty: no optimizer (forward only: inference, a frozen reference
        model); ``client``: a client optimizer to run as itself instead of the built-in Adam.

        The assembly, in order: settings and counters; the module on the device and equal on
        every rank; the flat groups; the NVMe preflight (before anything is partitioned); the
        stage-3 param store; per group the grad shard, param home, optimizer state and shard
        optimizer; the reducer and the fetch schedule; the step's policies."""
        super().__init__()
        self._read_settings(module, config, lr_scheduler, training_dataloader)
        self._prepare_module()
        store_groups = self._build_groups(param_groups)
        preflight(self.placement, self.groups, store_groups, self.stage >= 1, client, self.device)
        self._build_store(store_groups)
        self._build_updates(adamw, client)
        self._build_reducer()
        self._build_step_policies()
        check_working_set(self._working_set_bounds(), free_bytes(self.device), self.device.type)
        if self.global_rank == 0:
            self._log_memory()

    def _read_settings(self, module, config, lr_scheduler, training_dataloader) -> None:
        """What the components are built from; the counters at zero."""
        self.destroyed = False
        guards.take_over(module.parameters())
        # Params that require grad now but are left out of the optimizer on purpose (a subset
        # in model_parameters) are allowed; any other trainable param at a step is an error.
        self._known_params = {id(p) for p in module.parameters() if p.requires_grad}
        self.module, self.config = module, config
        self.lr_scheduler, self.training_dataloader = lr_scheduler, training_dataloader
        self.device = dist.default_device()
        if self.device.type == "cuda":  # streams, events and collectives act on the current one
            torch.cuda.set_device(self.device)
        self.dtype = config.dtype
        accum = config.data_types.grad_accum_dtype  # stages 2/3 only (the config checks)
        self.grad_accum_dtype = DTYPES[accum] if accum is not None else self.dtype
        self.world_size, self.global_rank = dist.world_size(), dist.rank()
        self.local_rank = dist.local_rank()
        resolve_auto_sizes(config, module)  # "auto" bucket sizes from the model's hidden size
        zc = config.zero_optimization
        self.stage = zc.stage
        self.placement = Placement.from_config(config, self.device, self.global_rank, run_name())
        nvme = self.placement.nvme
        self.aio = AioEngine(nvme.aio) if nvme is not None else None
        self.offload = self.placement.host_update
        oc = zc.offload_optimizer if self.offload else None
        self.delayed = bool(oc is not None and oc.delayed_update)
        self.delayed_after = int(oc.delayed_update_after) if self.delayed else 0
        self._gas = config.gradient_accumulation_steps
        # False: backward() only accumulates; each step() ends the window and updates.
        self.managed_accumulation = bool(config.managed_gradient_accumulation)
        self._in_unmanaged_step = False
        self._unmanaged_backwards = 0
        self.global_steps = self.global_samples = self.micro_steps = self.skipped_steps = 0
        self._grad_norm: float | None = None
        self._backward_done = False  # a window-ending (reducing) backward ran in this micro-step
        self._backward_since_step = False
        self._loss_scaled = False  # engine.scale(loss) was called since the last backward
        self._bw_last = False  # the running backward ends the accumulation window
        self._linears: list = []
        self.param_store: ParamStore | None = None
        self.fetch_schedule: FetchSchedule | None = None

    def _prepare_module(self) -> None:
        """Stages 0-2: params on the device in the training dtype; stage 3: buffers only (params
        are partitioned from wherever they are, one at a time). Then every rank holds rank 0's
        weights and the same config."""
        module = self.module
        if self.stage == 3:
            move_buffers(module, self.device)
            apply_leaf_config(module, self.config.zero_optimization.leaf_module)  # before units
        else:
            for p in module.parameters():
                materialize(p)
            cast_params_(module, self.device, self.dtype)  # buffers keep their own dtype
        synchronize_start(module, self.config)  # before any layout
        self.streams = Streams(self.device)
        self._executor = (
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="zero-offload-host-update")
            if self.delayed
            else None
        )

    def _build_groups(self, param_groups: list[dict]) -> list[FlatGroup] | None:
        """One flat group per optimizer param group (its ``hyper`` is the caller's dict itself,
        so a scheduler writing its "lr" reaches the update); stage 3: laid out one bucket per
        fetch unit, and returns the store's groups (plus one for every other param)."""
        module, zc, partitioned = self.module, self.config.zero_optimization, self.stage == 3
        names = {id(p): n for n, p in module.named_parameters()}
        order = {id(p): i for i, (_, p) in enumerate(module.named_parameters())}
        n_total = len(order)
        self._flat_positions = {pid: n_total - 1 - i for pid, i in order.items()}
        units = unit_ids(module) if partitioned else None

        def group(gi: int, params: list, hyper: dict) -> FlatGroup:
            params = sorted(params, key=lambda p: order.get(id(p), n_total))
            return FlatGroup(
                gi,
                params,
                [names.get(id(p), f"group{gi}.{i}") for i, p in enumerate(params)],
                hyper,
                self.dtype,
                self.device,
                self.world_size,
                self.global_rank,
                int(zc.reduce_bucket_size),
                layout=unit_layout(params, units, self.world_size) if partitioned else None,
                materialize=not partitioned,
            )

        self.groups = [group(gi, pg["params"], pg) for gi, pg in enumerate(param_groups)]
        if not partitioned:
            return None
        trained = {id(p) for g in self.groups for p in g.params}
        rest = [
            p
            for p in dict.fromkeys(module.parameters())
            if id(p) not in trained and (p.is_floating_point() or hasattr(p, "_z3_init"))
        ]
        return self.groups + ([group(len(self.groups), rest, {})] if rest else [])

    def _build_store(self, store_groups: list[FlatGroup] | None) -> None:
        """Stage 3: every param partitioned into the store (device, host or NVMe shards)."""
        if store_groups is None:
            return
        zc = self.config.zero_optimization
        if zc.memory_efficient_linear:
            self._linears = attach_linear(self.module)
        self.param_store = ParamStore(
            store_groups,
            [g in self.groups for g in store_groups],
            Stage3Policy.from_config(zc),
            self.streams,
            self.device,
            build_nvme_params(self.placement, self.aio),
        )

    def _build_reducer(self) -> None:
        """The gradient path (hooks, buckets, collectives) and, at stage 3, the fetch schedule
        (after the reducer: its hooks read a gradient before a slot is released)."""
        zc = self.config.zero_optimization
        self.scope = BackwardScope(self._backward_prologue)
        self.reducer = Reducer(
            self.groups,
            self.grad_shards,
            min(self.stage, 2),
            bool(zc.overlap_comm),
            bool(zc.reduce_scatter),
            self.streams,
            self._flat_positions,
            self.scope,
            ignore_unused=bool(zc.ignore_unused_parameters),
            average=self.config.gradient_allreduce_op == "mean",
            bucket_size=int(zc.reduce_bucket_size),
        )
        if self.param_store is not None:
            self.fetch_schedule = FetchSchedule(
                self.param_store, self.module, self.param_store.policy, self.scope
            )
            self.param_store.settle = self.flush_delayed_update
        self.scope.on_end(self._backward_epilogue, lambda: None)  # after the components' ends
        if not self.managed_accumulation:
            for gs in self.grad_shards:
                gs.ensure_device_accumulator()

    def _build_step_policies(self) -> None:
        """The optimizer users see, loss scaling, overflow handling, clipping, reporting."""
        config = self.config
        self.optimizer = ZeroOptimizer(self.groups, self.shard_opts) if self.groups else None
        self.loss_scaler = build_loss_scaler(config.fp16 if config.fp16.enabled else None)
        self._overflows = OverflowMonitor(
            self.loss_scaler.dynamic,
            float(config.fp16.min_loss_scale),
            int(config.max_consecutive_overflows),
            self.global_rank,
        )
        self.clip = float(config.gradient_clipping)
        self._t_step = time.perf_counter()
        self.wall_clock = bool(config.wall_clock_breakdown)
        self._times: dict[str, float] = {}

    def _build_updates(self, adamw: bool, client: torch.optim.Optimizer | None) -> None:
        """Per trainable group: its grad shard, its param home, its optimizer state (placed by
        ``self.placement``) and the shard optimizer that updates them."""
        zc, place = self.config.zero_optimization, self.placement
        sharded, partitioned = self.stage >= 1, self.stage == 3
        states = build_states(self.groups, sharded, place, self.aio, client is None)
        policy = UpdatePolicy(sharded, adamw, place)
        self.grad_shards, self.shard_opts = [], []
        for gi, (g, state) in enumerate(zip(self.groups, states)):
            gs = GradShard(
                g,
                min(self.stage, 2),  # stage 3 reduces gradients exactly as stage 2
                self.offload,
                self._gas,
                self.streams,
                place.pin,
                host_buffers=2 if self.delayed else 1,
                accum_dtype=self.grad_accum_dtype,
            )
            home = (
                ShardHome(self.param_store, gi)
                if partitioned
                else FlatHome(
                    g,
                    self.streams,
                    sharded,
                    int(zc.allgather_bucket_size),
                    bool(zc.allgather_partitions),
                )
            )
            so = ShardOptimizer(g, gs, home, state, policy, self.streams, self._executor, client)
            if partitioned:
                self.param_store.masters[gi] = so.state
            for i, p in enumerate(g.params):
                p._zero_offload = (weakref.ref(self), gi, i)
            self.grad_shards.append(gs)
            self.shard_opts.append(so)

    # ---- DeepSpeed API -------------------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        guards.check_alive(self.destroyed, "forward")
        if self.scope.open and not in_backward():
            self.scope.abandon()  # the last backward raised part way: start clean
        with self._timed("forward"):
            out = self.module(*inputs, **kwargs)
        self.scope.attach_outputs(out)  # a plain loss.backward() of these opens the backward
        return out

    def train(self, mode: bool = True):
        if not mode:  # evaluate on the newest params, not the one-step-old ones
            self.flush_delayed_update()
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self._gas

    def get_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        return self._grad_norm

    def zero_grad(self) -> None:
        for gs in self.grad_shards:
            gs.zero()

    def backward(
        self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True
    ) -> torch.Tensor:
        """Scale by the loss scale and (with ``scale_wrt_gas``) 1/GAS, run backward; reduction
        happens in the hooks. Returns the loss divided by GAS when ``scale_wrt_gas``, as
        DeepSpeed does.

        Non-boundary backwards (inside ``no_sync``, after ``set_gradient_accumulation_boundary
        (False)``, or before the last micro-step of a window) accumulate like torch's. After a
        backward that ended the window (it reduced), another one before ``step()`` raises: its
        gradient would be reduced twice or lost; sum the losses instead."""
        guards.check_loss(loss)
        guards.check_alive(self.destroyed, "backward")
        guards.check_has_optimizer(self.optimizer, "backward")
        self.scope.begin(ENGINE)
        gas = self._gas if scale_wrt_gas else 1
        scale = self.loss_scaler.loss_scale / gas
        scaled = loss * scale if scale != 1.0 else loss
        self.scope.attach_loss(scaled)  # the end is queued on this (the outermost) graph task
        with self._timed("backward"):
            try:
                scaled.backward(retain_graph=retain_graph)
            except BaseException:
                self.scope.abandon()
                raise
        self.scope.end()  # a no-op unless no graph task ran the end (a leaf loss)
        return loss / gas if gas != 1 else loss

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """DeepSpeed's ``engine.scale(loss)``: the loss times the fp16 loss scale, for a plain
        ``scale(loss).backward()`` (the engine still applies 1/GAS, to the gradients)."""
        guards.check_loss(loss)
        self._loss_scaled = True
        scale = self.loss_scaler.loss_scale
        return loss * scale if scale != 1.0 else loss

    def _backward_prologue(self, driver: str) -> None:
        """The start of every backward, through ``engine.backward`` (``ENGINE``, whose loss is
        already scaled) or a plain ``loss.backward()`` of the forward's output (``PLAIN``)."""
        guards.check_has_optimizer(self.optimizer, "backward")
        if self._backward_done:
            raise guards.second_backward_error()
        factor = 1.0
        if driver == PLAIN:
            if self.config.fp16.enabled and not self._loss_scaled:
                raise guards.unscaled_backward_error()
            factor = 1.0 / self._gas
        self._loss_scaled = False
        self._unmanaged_backwards += 1
        dist.set_step(self.global_steps)
        first = self._first_micro_step()
        self._bw_last = self._reduces_now()
        self.reducer.prepare(first, self._bw_last, factor)

    def _backward_epilogue(self) -> None:
        self._backward_done = self._bw_last
        self._backward_since_step = True

    def step(self) -> None:
        """Update at the accumulation boundary; always advances the micro-step counter.

        Every micro-step needs a backward() first: a step() without one raises."""
        guards.check_alive(self.destroyed, "step")
        guards.check_has_optimizer(self.optimizer, "step")
        if not self._backward_since_step:
            raise guards.step_without_backward_error(self.global_steps)
        self._before_step()
        self._backward_done = self._backward_since_step = False
        samples = self.config.train_micro_batch_size_per_gpu * self.world_size
        if not self.managed_accumulation:  # this step() is the boundary of its backwards
            samples *= self._unmanaged_backwards
            self._unmanaged_backwards = 0
            self._in_unmanaged_step = True
            guards.check_trained(self.module, self._known_params)
            try:
                self.reducer.finish_window()
                with self._timed("step"):
                    self._take_step()
            finally:
                self._in_unmanaged_step = False
        elif self.is_gradient_accumulation_boundary():
            guards.check_trained(self.module, self._known_params)
            with self._timed("step"):
                try:
                    self._take_step()
                except NvmeSwapError:  # rolled back: the micro-step is spent, a new window next
                    self.micro_steps += 1
                    self.global_samples += samples
                    self._window_start, self._window_steps = self.micro_steps, self.global_steps
                    raise
        self.micro_steps += 1
        self.global_samples += samples

    # ---- the update ----------------------------------------------------------------------------
    def _take_step(self) -> None:
        sumsq = torch.stack([gs.sumsq for gs in self.grad_shards]).sum()
        if self.stage >= 1:  # each rank holds its share; stage 0 ranks hold identical sums
            dist.all_reduce(sumsq)
        scale = self.loss_scaler.loss_scale
        norm = math.sqrt(float(sumsq)) / scale  # the step's one host sync
        overflow = not math.isfinite(norm)
        self._grad_norm = None if overflow else norm
        if overflow:
            self.skipped_steps += 1
            if self.delayed:
                for so in self.shard_opts:
                    so.flush()
        else:
            combined = scale
            if self.clip > 0:
                coef = (norm + 1e-6) / self.clip
                if coef > 1:
                    combined = scale * coef
            factor = 1.0 / combined
            guards.check_hyperparameters(self.optimizer.param_groups, self.global_steps)
            delayed = self.delayed and self.global_steps >= self.delayed_after
            if self.placement.optimizer == "nvme":
                self._nvme_step(factor)
            else:
                for so in self.shard_opts:
                    so.launch(factor) if delayed else so.step(factor)
            if self.lr_scheduler is not None:
                self.optimizer._opt_called = True  # torch's schedulers check the optimizer stepped
                self.lr_scheduler.step()
        self.loss_scaler.update_scale(overflow)
        self.zero_grad()
        self.global_steps += 1
        self._overflows.after_step(overflow, scale, self.loss_scaler.loss_scale, self.global_steps)
        every = self.config.steps_per_print
        if self.global_rank == 0 and every and self.global_steps % every == 0:
            self._log_step(overflow, every)
        if (
            self.wall_clock
            and self.global_rank == 0
            and (not every or self.global_steps % every == 0)
        ):
            self._log_wall_clock()

    def _nvme_step(self, factor: float) -> None:
        """Every group's update written, then committed only if every group on every rank
        succeeded (one flag all-reduced); otherwise every rank rolls every group back to the
        last committed step and raises: the master weights and moments never hold a partial
        step, and the ranks never disagree on which step they hold."""
        error = None
        for so in self.shard_opts:
            try:
                so.stage(factor)
            except Exception as e:
                error = e
                break
        failed = 0 if error is None else 1
        if self.world_size > 1:  # one rank's failure is every rank's
            flag = torch.tensor([failed], dtype=torch.int32, device=self.device)
            dist.all_reduce(flag)
            failed = int(flag.item())
        if not failed:
            for so in self.shard_opts:
                so.commit()
            return
        for so in self.shard_opts:  # every group on every rank: no collective from here on
            so.discard()
        rollback = None
        for so in self.shard_opts:
            try:
                so.restore_params()
            except Exception as e:  # the disk may still be failing: restore what can be
                rollback = rollback or e
        self.zero_grad()  # the window's gradients are spent: a retry starts a new window
        if error is not None and not isinstance(error, NvmeSwapError):
            wrapped = NvmeSwapError(
                f"the NVMe update failed ({type(error).__name__}: {error}); every rank kept the "
                "last committed step"
            )
            wrapped.__cause__ = error
            error = wrapped
        if error is None:
            error = NvmeSwapError(
                f"the NVMe update failed on {failed} other rank(s) at step "
                f"{self.global_steps + 1} (their error names the file); every rank kept the "
                "last committed step"
            )
        if rollback is not None:
            error.add_note(f"restoring the params from the committed master failed too: {rollback}")
        raise error

    def flush_delayed_update(self) -> None:
        """With the delayed update: apply the pending host update now (before eval or saving)."""
        for so in self.shard_opts:
            so.flush()

    # ---- reporting -----------------------------------------------------------------------------
    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds per category ("device.*", "host.*")."""
        parts = [gs.nbytes() for gs in self.grad_shards] + [so.nbytes() for so in self.shard_opts]
        if self.param_store is not None:
            parts.append(self.param_store.nbytes())
        else:
            parts.append(
                {"device.params": sum(g.flat.numel() * g.flat.element_size() for g in self.groups)}
            )
        out: dict[str, int] = {}
        for part in parts:
            for k, v in part.items():
                out[k] = out.get(k, 0) + v
        for k, v in self.reducer.transient_peaks().items():
            out[f"peak.{k}"] = v
        if self.param_store is not None:
            esize = self.dtype.itemsize
            out["peak.device.gathered_params"] = self.param_store.peak_live * esize
        return out

    def reset_peak_memory(self) -> None:
        """Start the ``peak.*`` entries of ``memory_report()`` again from what is held now (the
        first backward, before the reduction order is learned, can exceed a later step's)."""
        self.reducer.bufs.reset_peak()
        if self.param_store is not None:
            self.param_store.peak_live = self.param_store.live

    def _working_set_bounds(self) -> dict[str, int]:
        """The step's transient bytes the config allows, known once the engine is built."""
        out = self.reducer.bounds()
        store = self.param_store
        if store is not None and store.slots:
            total = sum(s.numel for s in store.slots)
            live = store.policy.max_live_parameters + max(s.numel for s in store.slots)
            out["gathered_params"] = min(total, live) * self.dtype.itemsize
        return out

    def expected_memory(
        self,
        seq_length: int | None = None,
        micro_batch: int | None = None,
        checkpointing: bool | None = None,
    ) -> dict[str, int]:
        """The formula's model-state bytes for this engine's padded sizes. With ``seq_length``
        also the step's predicted peak (``peak.*``, see ``memory_model.predict``) for the
        module's shape (its ``config``: this library's GPT-2 or a Hugging Face one), the micro
        batch (default: the config's) and activation checkpointing (default: the model's)."""
        if seq_length is None:
            return self._expected_states()
        cfg = getattr(self.module, "config", None)
        if cfg is None:
            raise ValueError(
                "expected_memory(seq_length=...): the module has no .config to read its shape "
                "from; use zero_offload.runtime.memory_model.predict with a ModelShape"
            )
        if checkpointing is None:
            checkpointing = bool(
                getattr(cfg, "checkpoint_activations", False)
                or getattr(self.module, "is_gradient_checkpointing", False)
            )
        step = StepShape(micro_batch or self.train_micro_batch_size_per_gpu(), seq_length,
                         checkpointing)  # fmt: skip
        plan = ZeroPlan.from_config(self.config, self.world_size)
        total = sum(g.layout.total for g in self.groups)
        return predict(ModelShape.from_config(cfg), step, plan, numel=total)

    def _expected_states(self) -> dict[str, int]:
        total = sum(g.layout.total for g in self.groups)
        return expected_bytes(
            total,
            self.dtype,
            self.stage,
            self.world_size,
            self.offload,
            self._gas,
            self.delayed,
            offload_param=self.config.zero_optimization.offload_params,
        )

    def _log_memory(self) -> None:
        have, want = self.memory_report(), self.expected_memory()
        lines = [
            f"model-state memory per rank (stage {self.stage}, world {self.world_size}, "
            f"optimizer on {self.placement.optimizer}, params on {self.placement.params}):"
        ]
        for k in sorted(set(have) | set(want)):
            lines.append(
                f"  {k:<24} {have.get(k, 0) / 2**20:10.2f} MiB   formula {want.get(k, 0) / 2**20:10.2f} MiB"
            )
        if self.device.type == "cuda":
            lines.append(
                f"  cuda max_memory_allocated {torch.cuda.max_memory_allocated(self.device) / 2**20:.1f} MiB"
            )
        log.info("\n".join(lines))

    def _log_step(self, overflow: bool, every: int) -> None:
        now = time.perf_counter()
        dt, self._t_step = now - self._t_step, now
        log.info(
            "step=%d skipped=%d lr=%s loss_scale=%g grad_norm=%s overflow=%s %.3fs/step",
            self.global_steps,
            self.skipped_steps,
            [round(x, 8) for x in self.get_lr()],
            self.loss_scale,
            self._grad_norm,
            overflow,
            dt / every,
        )

    def _timed(self, name: str):
        """wall_clock_breakdown: time a phase (synchronizing CUDA so the time is the device's)."""
        engine = self

        class _Timer:
            def __enter__(self):
                if engine.device.type == "cuda":
                    torch.cuda.synchronize(engine.device)
                self.t = time.perf_counter()

            def __exit__(self, *exc):
                if engine.device.type == "cuda":
                    torch.cuda.synchronize(engine.device)
                engine._times[name] = engine._times.get(name, 0.0) + time.perf_counter() - self.t

        return _Timer() if self.wall_clock else contextlib.nullcontext()

    def _log_wall_clock(self) -> None:
        parts = " | ".join(f"{k}: {v * 1e3:.1f} ms" for k, v in self._times.items())
        log.info("time (total since last report) %s", parts)
        self._times.clear()

    # ---- checkpoints (see zero_offload.checkpoint) --------------------------------------------
    def save_checkpoint(
        self,
        save_dir,
        tag=None,
        client_state=None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ):
        from ..checkpoint import save_checkpoint

        return save_checkpoint(
            self,
            save_dir,
            tag=tag,
            client_state=client_state,
            save_latest=save_latest,
            exclude_frozen_parameters=exclude_frozen_parameters,
        )

    def load_checkpoint(
        self,
        load_dir,
        tag=None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn=None,
    ):
        """DeepSpeed's signature and argument order."""
        from ..checkpoint import load_checkpoint

        if custom_load_fn is not None:
            raise NotImplementedError(
                "load_checkpoint(custom_load_fn=...): not supported; zero_offload checkpoints "
                "load into the engine's own shards (load_module_only=True loads the weights alone)"
            )
        return load_checkpoint(
            self,
            load_dir,
            tag=tag,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
            load_module_strict=load_module_strict,
        )

    def save_16bit_model(
        self,
        save_dir,
        save_filename: str = "model.safetensors",
        exclude_frozen_parameters: bool = False,
        max_shard_size: int | str | None = None,
    ):
        """DeepSpeed's; ``max_shard_size`` (this project's): Hugging Face's sharded layout."""
        from ..checkpoint import save_16bit_model

        return save_16bit_model(
            self, save_dir, save_filename, exclude_frozen_parameters, max_shard_size
        )

    def empty_partition_cache(self) -> None:
        """Stage 3: free every gathered param, persistent ones too (the next forward gathers
        them again); below stage 3 there is nothing to free."""
        if self.param_store is not None:
            self.param_store.empty_cache()

    def __getattr__(self, name: str):
        """DeepSpeed's engine passes unknown attributes through to the module it wraps."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None or name.startswith("__"):
                raise
            try:
                return getattr(module, name)
            except AttributeError:
                raise AttributeError(
                    f"'{type(self).__name__}' object (and its module, a "
                    f"{type(module).__name__}) has no attribute '{name}'"
                ) from None

    def params_on_host(self, write_back: bool = False):
        """Stage 3: every param bound to a full host copy for the block (see ParamStore); a
        no-op context at stages 0-2, whose params are always whole."""
        if self.param_store is None:
            return contextlib.nullcontext()
        return self.param_store.params_on_host(write_back)

    def destroy(self) -> None:
        """Release the model: pending update applied, hooks removed, worker thread joined; at
        stage 3 the params stay partitioned, as ``zero.Init`` leaves them (a later initialize()
        lays them out again). A collective at stage 3. The engine then refuses to run."""
        if self.destroyed:
            return
        self.flush_delayed_update()
        if self.param_store is not None:
            self.param_store.release_to_init_form()
        self.destroyed = True
        self.reducer.remove()
        if self.fetch_schedule is not None:
            self.fetch_schedule.remove()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self._discard_swap_files()
        if self.aio is not None:
            self.aio.close()
        detach_linear(self._linears)
        for g in self.groups:
            for p in g.params:
                if hasattr(p, "_zero_offload"):
                    del p._zero_offload

    def _discard_swap_files(self) -> None:
        """NVMe swap files are scratch: gone with the engine (a checkpoint holds the state)."""
        swapped = self.param_store.swapped.values() if self.param_store is not None else ()
        for owner in [so.state for so in self.shard_opts] + list(swapped):
            close = getattr(owner, "close", None)
            if close is not None:
                close()
