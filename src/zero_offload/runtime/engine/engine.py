"""The engine: a thin orchestrator of the components, with DeepSpeed's engine API.

Built once from the validated config (``assembly.py``); the hot path (backward hooks, step)
never re-reads it.
``engine(*inputs)`` runs the module, ``backward(loss)`` scales the loss (fp16 scale, 1/GAS) and
runs autograd while the reducer moves gradients out, ``step()`` updates at the accumulation
boundary only.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time

import torch

from ...activation_checkpointing import COUNTERS as CHECKPOINT_BYTES
from ...activation_checkpointing import policy as checkpoint_policy
from ...core import dist, host_heap, partitioned
from ...core.partitioned import shape_of
from ...nvme.errors import NvmeSwapError
from ...nvme.io.trace import mark as trace_mark
from ..backward_scope import ENGINE, PLAIN, in_backward
from ..offload_states.offload_states import (
    BACKWARD_NEEDS,
    EVERYTHING,
    FORWARD_NEEDS,
    GRADS_NEED,
    MASTER_NEEDED,
    MovedStates,
    OffloadStatesAPI,
)
from ..plan.memory import expected_bytes
from ..plan.memory_bounds import check_working_set, free_bytes
from ..plan.memory_model import StepShape, nvme_optimizer_terms, predict
from ..plan.model_shape import ModelShape
from ..plan.zenflow_memory import zenflow_bytes
from ..precision.overflow_cause import overflow_cause
from ..stage3.memory_efficient_linear import detach as detach_linear
from ..update.group_step import StepRolledBackError, step_groups
from . import guards
from .assembly import assemble
from .deepspeed_api.compile import CompileAPI
from .deepspeed_api.engine_api import DeepSpeedEngineAPI
from .deepspeed_api.engine_compat import DeepSpeedCompatAPI
from .parts import EngineHooks, EngineParts
from .python_gc import PYTHON_GC

log = logging.getLogger("zero_offload")


class ZeroOffloadEngine(
    DeepSpeedEngineAPI, DeepSpeedCompatAPI, CompileAPI, OffloadStatesAPI, torch.nn.Module
):
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
        Its parts are built by ``assembly.assemble``, the only code that reads the config."""
        super().__init__()
        # The engine's own state: counters, and what the last calls left behind.
        self.destroyed = False
        self.global_steps = self.global_samples = self.micro_steps = self.skipped_steps = 0
        self._grad_norm: float | None = None
        self._loss_scaled = False  # engine.scale(loss) was called since the last backward
        self._holds_python_gc = False  # taken once the engine is built, released by destroy()
        self._t_step = time.perf_counter()  # steps_per_print's last report
        self._times: dict[str, float] = {}  # wall_clock_breakdown's phases since its last report
        hooks = EngineHooks(
            self._backward_prologue, self._backward_epilogue, self._before_param_edit
        )
        self._adopt(
            assemble(
                hooks, module, config, param_groups, adamw, lr_scheduler, training_dataloader,
                client,
            )
        )  # fmt: skip
        self.moved = MovedStates(self.placement.delayed)  # what offload_states() moved
        for og in self.opt_groups:  # the tensor-fragment API finds a param's group by this
            for i, p in enumerate(og.flat.params):
                partitioned.link_engine(p, self, og.index, i)
        check_working_set(self._working_set_bounds(), free_bytes(self.device), self.device.type)
        # Loading and partitioning the model freed its full copies: malloc's heap gives the
        # pages back here once, and what it holds free from now on is a named term.
        host_heap.release()
        self._heap = host_heap.HeapPeak()
        if self.global_rank == 0:
            self._log_memory()
        if self._python_gc_off:  # disable_python_gc
            PYTHON_GC.acquire()
            self._holds_python_gc = True

    def _adopt(self, parts: EngineParts) -> None:
        """The engine's fixed fields: the assembly's parts (``EngineParts`` says what each is),
        under the same names; the step policies' under a leading underscore."""
        self.module = parts.module
        self.config = parts.config  # kept whole for DeepSpeed's accessors and checkpoints
        self.lr_scheduler, self.training_dataloader = parts.lr_scheduler, parts.training_dataloader
        self.device, self.dtype, self.grad_accum_dtype = (
            parts.device,
            parts.dtype,
            parts.grad_accum_dtype,
        )
        self.autocast, self.checkpoint_policy = parts.autocast, parts.checkpoint_policy
        self.world_size, self.global_rank = parts.world_size, parts.global_rank
        self.local_rank, self.stage = parts.local_rank, parts.stage
        self.zero_plan, self.placement, self.window = parts.zero_plan, parts.placement, parts.window
        self._known_params = parts.known_params
        self.streams, self.aio, self._executor = parts.streams, parts.aio, parts.executor
        self._linears = parts.linears
        self.param_store, self.fetch_schedule = parts.param_store, parts.fetch_schedule
        self.opt_groups = parts.opt_groups
        self.scope, self.reducer = parts.scope, parts.reducer
        self.optimizer, self.loss_scaler = parts.optimizer, parts.loss_scaler
        if self.optimizer is not None:
            self.optimizer.attach(self)  # it asks the engine about overflow and loss scaling
        self._overflows, self.clip, self._fp16 = parts.overflows, parts.clip, parts.fp16
        self._print_every, self._micro_batch = parts.print_every, parts.micro_batch
        self.wall_clock, self._report_grad_norm = parts.wall_clock, parts.report_grad_norm
        self._python_gc_off = parts.python_gc_off

    # ---- DeepSpeed API -------------------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        guards.check_alive(self.destroyed, "forward")
        self.moved.require("engine.forward()", FORWARD_NEEDS)
        if self.scope.open and not in_backward():
            self.scope.abandon()  # the last backward raised part way: start clean
        trace_mark("forward")
        with self._timed("forward"), self.autocast.context():
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

    def gradient_accumulation_steps(self) -> int:
        return self.window.gas

    def get_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        return self._grad_norm

    def zero_grad(self) -> None:
        self.moved.require("engine.zero_grad()", GRADS_NEED)
        for og in self.opt_groups:
            og.grads.zero()

    def backward(
        self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True
    ) -> torch.Tensor:
        """Scale by the loss scale and (with ``scale_wrt_gas``) 1/GAS, run backward; reduction
        happens in the hooks. Returns the loss divided by GAS when ``scale_wrt_gas``, as
        DeepSpeed does.

        Non-boundary backwards (inside ``no_sync``, after ``set_gradient_accumulation_boundary
        (False)``, or before the last micro-step of a window) accumulate like torch's. Several
        backwards before one ``step()`` at the boundary (two losses, a loss per sub-batch) also
        accumulate: each one after the first adds its reduced gradient to the window's, so the
        step sees what ``backward(l1 + l2)`` gives."""
        guards.check_loss(loss)
        guards.check_alive(self.destroyed, "backward")
        guards.check_has_optimizer(self.optimizer, "backward")
        self.scope.begin(ENGINE)
        gas = self.window.gas if scale_wrt_gas else 1
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
        guards.check_loss(loss, "engine.scale(loss)")
        self._loss_scaled = True
        scale = self.loss_scaler.loss_scale
        return loss * scale if scale != 1.0 else loss

    def _backward_prologue(self, driver: str) -> None:
        """The start of every backward, through ``engine.backward`` (``ENGINE``, whose loss is
        already scaled) or a plain ``loss.backward()`` of the forward's output (``PLAIN``)."""
        guards.check_has_optimizer(self.optimizer, "backward")
        self.moved.require("engine.backward()", BACKWARD_NEEDS)
        reopens = self.window.reopens()
        trace_mark("backward")
        factor = 1.0
        if driver == PLAIN:
            if self._fp16 and not self._loss_scaled:
                raise guards.unscaled_backward_error()
            factor = 1.0 / self.window.gas
        self._loss_scaled = False
        dist.set_step(self.global_steps)
        first, last = self.window.begin_backward(self.global_steps, self.micro_steps)
        if reopens:  # a backward already ended this window: keep its sum, add this one's
            for og in self.opt_groups:
                og.grads.reopen()
        if not last:  # a window of several backwards (built with GAS 1: allocated now)
            for og in self.opt_groups:
                og.grads.ensure_device_accumulator()
        self.reducer.prepare(first, last, factor)
        if last:  # the update follows this backward: start what it can do already
            for og in self.opt_groups:
                og.prepare()

    def _backward_epilogue(self) -> None:
        self.window.end_backward()
        self._heap.sample()  # the module's gathered params and gradients were freed by now

    def step(self) -> None:
        """Update at the accumulation boundary; always advances the micro-step counter.

        Every micro-step needs a backward() first: a step() without one raises."""
        guards.check_alive(self.destroyed, "step")
        guards.check_has_optimizer(self.optimizer, "step")
        window = self.window
        if not window.managed or self.is_gradient_accumulation_boundary():
            self.moved.require("engine.step()", EVERYTHING)  # an update: it reads every state
        window.begin_step(self.global_steps)
        trace_mark("step")
        self._before_step_counts = (self.global_steps, self.skipped_steps)
        samples = self._micro_batch * self.world_size
        if not window.managed:  # this step() is the boundary of its backwards
            samples *= window.backwards
            window.backwards = 0
            window.in_step = True
            guards.check_trained(self.module, self._known_params)
            try:
                self.reducer.finish_window()
                with self._timed("step"):
                    self._take_step()
            finally:
                window.in_step = False
        elif self.is_gradient_accumulation_boundary():
            guards.check_trained(self.module, self._known_params)
            with self._timed("step"):
                try:
                    self._take_step()
                except (NvmeSwapError, StepRolledBackError):  # rolled back: the micro-step is
                    # spent, a new window next
                    self.micro_steps += 1
                    self.global_samples += samples
                    window.restart(self.global_steps, self.micro_steps)
                    raise
        self.micro_steps += 1
        self.global_samples += samples
        self._heap.sample()
        trace_mark("step_end")

    # ---- the update ----------------------------------------------------------------------------
    def _take_step(self) -> None:
        grads = [og.grads for og in self.opt_groups]
        sumsq = torch.stack([gs.sumsq for gs in grads]).sum()
        if self.stage >= 1:  # each rank holds its share; stage 0 ranks hold identical sums
            dist.all_reduce(sumsq)
        scale = self.loss_scaler.loss_scale
        norm = math.sqrt(float(sumsq)) / scale  # the step's one host sync
        overflow = not math.isfinite(norm)
        self._grad_norm = None if overflow or not self._report_grad_norm else norm
        cause = None
        if overflow:
            cause = overflow_cause(grads, scale, self.stage >= 1)
            self.skipped_steps += 1
            for og in self.opt_groups:
                og.skip()
        else:
            combined = scale
            if self.clip > 0:
                coef = (norm + 1e-6) / self.clip
                if coef > 1:
                    combined = scale * coef
            factor = 1.0 / combined
            guards.check_hyperparameters(self.optimizer.param_groups, self.global_steps)
            step_groups(
                self.opt_groups,
                factor,
                self.global_steps,
                self.world_size,
                self.device,
                on_rollback=self.zero_grad,  # the window's gradients are spent
            )
            if self.lr_scheduler is not None:
                self.optimizer._opt_called = True  # torch's schedulers check the optimizer stepped
                self.lr_scheduler.step()
        if self.param_store is not None:  # persistent params full between steps, as DeepSpeed's
            self.param_store.gather_persistent()
        self.loss_scaler.update_scale(overflow)
        self.zero_grad()
        self.global_steps += 1
        self._overflows.after_step(
            overflow, scale, self.loss_scaler.loss_scale, self.global_steps, cause
        )
        every = self._print_every
        if self.global_rank == 0 and every and self.global_steps % every == 0:
            self._log_step(overflow, every)
        if (
            self.wall_clock
            and self.global_rank == 0
            and (not every or self.global_steps % every == 0)
        ):
            self._log_wall_clock()

    def _before_param_edit(self) -> None:
        """Stage 3, before a ``GatheredParameters(modifier_rank=...)`` block: its exit writes
        the fp32 master shard too, which must be on the device; then the pending update."""
        self.moved.require("GatheredParameters(modifier_rank=...)", MASTER_NEEDED)
        self.flush_delayed_update()

    def flush_delayed_update(self) -> None:
        """With the delayed update: apply the pending host update now (before eval or saving)."""
        self.moved.require_flush("engine.flush_delayed_update()")
        for og in self.opt_groups:
            og.flush()

    # ---- reporting -----------------------------------------------------------------------------
    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds per category ("device.*", "host.*"); ``peak.*``: the most a
        step's transient parts held, among them the inputs ``deepspeed.checkpointing`` keeps
        (``peak.device.activation_checkpoints``, ``peak.host.activation_checkpoints``)."""
        parts = [og.nbytes() for og in self.opt_groups]
        if self.param_store is not None:
            parts.append(self.param_store.nbytes())
        else:
            flats = [og.flat.flat for og in self.opt_groups]
            parts.append({"device.params": sum(f.numel() * f.element_size() for f in flats)})
        out: dict[str, int] = {}
        for part in parts:
            for k, v in part.items():
                out[k] = out.get(k, 0) + v
        self.moved.report(out)  # offload_states(): now on the host
        for k, v in self.reducer.transient_peaks().items():
            out[f"peak.{k}"] = v
        out.update(CHECKPOINT_BYTES.report())  # deepspeed.checkpointing's kept inputs
        if self.param_store is not None:
            esize = self.dtype.itemsize
            out["peak.device.gathered_params"] = self.param_store.peak_live * esize
        if host_heap.free_bytes() is not None:  # freed host memory malloc keeps for reuse
            out["peak.host.allocator_free"] = self._heap.peak
        return out

    def reset_peak_memory(self) -> None:
        """Start the ``peak.*`` entries of ``memory_report()`` again from what is held now (the
        first backward, before the reduction order is learned, can exceed a later step's)."""
        self.reducer.bufs.reset_peak()
        self._heap.reset()
        CHECKPOINT_BYTES.reset_peak()
        if self.param_store is not None:
            self.param_store.reset_peak()

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
        cpu_checkpointing: bool | None = None,
    ) -> dict[str, int]:
        """The formula's model-state bytes for this engine's padded sizes. With ``seq_length``
        also the step's predicted peak (``peak.*``, see ``memory_model.predict``) for the
        module's shape (its ``config``: this library's GPT-2 or a Hugging Face one), the micro
        batch (default: the config's), activation checkpointing (default: the model's) and
        its inputs in host memory (default: with this library's GPT-2, which checkpoints
        through ``deepspeed.checkpointing`` then, the API's ``cpu_checkpointing``)."""
        if seq_length is None:
            return self._expected_states()
        cfg = getattr(self.module, "config", None)
        if cfg is None:
            raise ValueError(
                "expected_memory(seq_length=...): the module has no .config to read its shape "
                "from; use zero_offload.runtime.plan.memory_model.predict with a ModelShape"
            )
        if checkpointing is None:
            checkpointing = bool(
                getattr(cfg, "checkpoint_activations", False)
                or getattr(self.module, "is_gradient_checkpointing", False)
            )
        if cpu_checkpointing is None:
            own = getattr(cfg, "checkpoint_activations", False)  # this library's GPT-2
            cpu_checkpointing = bool(
                checkpointing and own and checkpoint_policy().cpu_checkpointing
            )
        step = StepShape(micro_batch or self.train_micro_batch_size_per_gpu(), seq_length,
                         checkpointing, cpu_checkpointing)  # fmt: skip
        plan = self.zero_plan
        total = sum(og.flat.layout.total for og in self.opt_groups)
        return predict(ModelShape.from_config(cfg), step, plan, numel=total)

    def _expected_states(self) -> dict[str, int]:
        groups = self.opt_groups
        total = sum(og.flat.layout.total for og in groups)
        out = expected_bytes(
            total,
            self.dtype,
            self.stage,
            self.world_size,
            self.placement.host_update,
            self.window.gas,
            self.placement.delayed,
            offload_param=self.placement.params != "device",
            ratio=self.placement.ratio,
            accum_dtype=self.grad_accum_dtype,
            alias_master=all(og.optimizer.aliased for og in groups) if groups else None,
            muon_numel=sum(og.flat.layout.total for og in groups if og.flat.hyper.get("use_muon")),
            state=self.zero_plan.state,
        )
        if self.placement.optimizer == "nvme" and groups:  # the swap files, as reported
            shards = [og.optimizer.state.numel for og in groups]
            nvme_optimizer_terms(out, shards, self.zero_plan)
        if self.placement.params == "nvme" and "host.param_shard" in out:  # as reported
            out["nvme.param_shard"] = out.pop("host.param_shard")
        zenflow = self.zero_plan.zenflow  # built: each group's own params, on this rank
        for og in groups if zenflow is not None else ():
            shapes = [shape_of(p) for p in reversed(og.flat.params)]  # registration order
            layout, grad_bytes = og.flat.layout, self.grad_accum_dtype.itemsize
            got = zenflow_bytes(shapes, layout.shard_numel, zenflow, layout.world_size, grad_bytes)
            for k, v in got.items():
                out[k] = out.get(k, 0) + v
        persistent = self.param_store.persistent_bytes() if self.param_store is not None else 0
        if persistent:  # stage 3: gathered from the first step on (DeepSpeed's persistent params)
            out["device.persistent_params"] = persistent
        return out

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
        from ...checkpoint import save_checkpoint

        self.moved.require("engine.save_checkpoint()", EVERYTHING)
        if not save_dir:  # DeepSpeed's check, before anything else
            raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")
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
        from ...checkpoint import load_checkpoint

        self.moved.require("engine.load_checkpoint()", EVERYTHING)
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
        from ...checkpoint import save_16bit_model

        self.moved.require("engine.save_16bit_model()", FORWARD_NEEDS)
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
        self.moved.reload()  # the pending update and stage 3's release read the states
        self.flush_delayed_update()
        if self.param_store is not None:
            self.param_store.release_to_init_form()
        self.destroyed = True
        if self._holds_python_gc:
            PYTHON_GC.release()
        self.reducer.remove()
        if self.fetch_schedule is not None:
            self.fetch_schedule.remove()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self._discard_swap_files()
        if self.aio is not None:
            self.aio.close()
        detach_linear(self._linears)
        for og in self.opt_groups:
            for p in og.flat.params:
                partitioned.unlink_engine(p)

    def _discard_swap_files(self) -> None:
        """Every group closed (its NVMe swap file is scratch, gone with the engine: a checkpoint
        holds the state), then the param store's swap files."""
        for og in self.opt_groups:
            og.close()
        if self.param_store is not None:
            for shard in self.param_store.swapped.values():
                shard.close()
