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

from . import dist
from .engine_api import DeepSpeedEngineAPI
from .flat_group import FlatGroup
from .grad_shard import GradShard
from .loss_scaler import build_loss_scaler
from .memory import expected_bytes
from .module_cast import cast_params_
from .reducer import Reducer
from .shard_optimizer import ShardOptimizer
from .streams import Streams
from .zero_optimizer import ZeroOptimizer

log = logging.getLogger("zero_offload")


class ZeroOffloadEngine(DeepSpeedEngineAPI, torch.nn.Module):
    def __init__(
        self,
        module: torch.nn.Module,
        config,
        param_groups: list[dict],
        adamw: bool,
        lr_scheduler=None,
        training_dataloader=None,
    ) -> None:
        super().__init__()
        self.module = module
        self.config = config
        self.device = dist.default_device()
        self.dtype = config.dtype
        self.world_size, self.global_rank, self.local_rank = (
            dist.world_size(),
            dist.rank(),
            dist.local_rank(),
        )
        zc = config.zero_optimization
        self.stage = zc.stage
        self.offload = zc.offload_device == "cpu"
        oc = zc.offload_optimizer if self.offload else None
        self.delayed = bool(oc is not None and oc.delayed_update)
        self.delayed_after = int(oc.delayed_update_after) if self.delayed else 0
        self._gas = config.gradient_accumulation_steps
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._grad_norm: float | None = None
        self.training_dataloader = training_dataloader

        cast_params_(module, self.device, self.dtype)
        self.streams = Streams(self.device)
        pin = bool(oc is not None and oc.pin_memory and self.device.type == "cuda")
        names = {id(p): n for n, p in module.named_parameters()}
        order = {id(p): i for i, (_, p) in enumerate(module.named_parameters())}
        n_total = len(order)
        sharded = self.stage >= 1
        self.groups, self.grad_shards, self.shard_opts = [], [], []
        self._executor = (
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="zero-offload-host-update")
            if self.delayed
            else None
        )
        for gi, pg in enumerate(param_groups):
            params = sorted(pg["params"], key=lambda p: order.get(id(p), n_total))
            hyper = pg  # the caller's dict itself: a scheduler writing its "lr" reaches the update
            g = FlatGroup(
                gi,
                params,
                [names.get(id(p), f"group{gi}.{i}") for i, p in enumerate(params)],
                hyper,
                self.dtype,
                self.device,
                self.world_size,
                self.global_rank,
                int(zc.reduce_bucket_size),
            )
            gs = GradShard(
                g,
                self.stage,
                self.offload,
                self._gas,
                self.streams,
                pin,
                host_buffers=2 if self.delayed else 1,
            )
            so = ShardOptimizer(
                g,
                gs,
                sharded,
                self.offload,
                adamw,
                self.streams,
                pin,
                oc.threads if oc is not None else None,
                int(zc.allgather_bucket_size),
                self._executor,
                bool(zc.allgather_partitions),
            )
            for i, p in enumerate(g.params):
                p._zero_offload = (weakref.ref(self), gi, i)
            self.groups.append(g)
            self.grad_shards.append(gs)
            self.shard_opts.append(so)
        pos = {pid: n_total - 1 - i for pid, i in order.items()}
        self.reducer = Reducer(
            self.groups,
            self.grad_shards,
            self.stage,
            bool(zc.overlap_comm),
            bool(zc.reduce_scatter),
            self.streams,
            pos,
            ignore_unused=bool(zc.ignore_unused_parameters),
        )
        self.optimizer = ZeroOptimizer(self.groups, self.shard_opts)
        self.loss_scaler = build_loss_scaler(config.fp16 if config.fp16.enabled else None)
        self.lr_scheduler = lr_scheduler
        self.clip = float(config.gradient_clipping)
        self._t_step = time.perf_counter()
        self.wall_clock = bool(config.wall_clock_breakdown)
        self._times: dict[str, float] = {}
        if self.global_rank == 0:
            self._log_memory()

    # ---- DeepSpeed API -------------------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        with self._timed("forward"):
            return self.module(*inputs, **kwargs)

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
        DeepSpeed does."""
        first = self._first_micro_step()
        self.reducer.prepare(first=first, last=self._reduces_now())
        gas = self._gas if scale_wrt_gas else 1
        scale = self.loss_scaler.loss_scale / gas
        with self._timed("backward"):
            (loss * scale if scale != 1.0 else loss).backward(retain_graph=retain_graph)
        return loss / gas if gas != 1 else loss

    def step(self) -> None:
        """Update at the accumulation boundary; always advances the micro-step counter."""
        self._before_step()
        if self.is_gradient_accumulation_boundary():
            with self._timed("step"):
                self._take_step()
        self.micro_steps += 1
        self.global_samples += self.config.train_micro_batch_size_per_gpu * self.world_size

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
            delayed = self.delayed and self.global_steps >= self.delayed_after
            for so in self.shard_opts:
                so.launch(factor) if delayed else so.step(factor)
            if self.lr_scheduler is not None:
                self.optimizer._opt_called = True  # torch's schedulers check the optimizer stepped
                self.lr_scheduler.step()
        self.loss_scaler.update_scale(overflow)
        self.zero_grad()
        self.global_steps += 1
        every = self.config.steps_per_print
        if self.global_rank == 0 and every and self.global_steps % every == 0:
            self._log_step(overflow, every)
        if (
            self.wall_clock
            and self.global_rank == 0
            and (not every or self.global_steps % every == 0)
        ):
            self._log_wall_clock()

    def flush_delayed_update(self) -> None:
        """With the delayed update: apply the pending host update now (before eval or saving)."""
        for so in self.shard_opts:
            so.flush()

    # ---- reporting -----------------------------------------------------------------------------
    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds per category ("device.*", "host.*")."""
        out: dict[str, int] = {
            "device.params": sum(g.flat.numel() * g.flat.element_size() for g in self.groups)
        }
        for part in [gs.nbytes() for gs in self.grad_shards] + [
            so.nbytes() for so in self.shard_opts
        ]:
            for k, v in part.items():
                out[k] = out.get(k, 0) + v
        if self.reducer.bucket_pool_bytes():
            out["device.grad_buckets"] = self.reducer.bucket_pool_bytes()
        return out

    def expected_memory(self) -> dict[str, int]:
        """The formula's figure for this engine's padded sizes (buckets excluded)."""
        total = sum(g.layout.total for g in self.groups)
        return expected_bytes(
            total, self.dtype, self.stage, self.world_size, self.offload, self._gas, self.delayed
        )

    def _log_memory(self) -> None:
        have, want = self.memory_report(), self.expected_memory()
        lines = [
            f"model-state memory per rank (stage {self.stage}, world {self.world_size}, "
            f"offload {'cpu' if self.offload else 'none'}):"
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
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest: bool = True):
        from ..checkpoint import save_checkpoint

        return save_checkpoint(
            self, save_dir, tag=tag, client_state=client_state, save_latest=save_latest
        )

    def load_checkpoint(
        self,
        load_dir,
        tag=None,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ):
        from ..checkpoint import load_checkpoint

        return load_checkpoint(
            self,
            load_dir,
            tag=tag,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
        )

    def save_16bit_model(
        self,
        save_dir,
        save_filename: str = "model.safetensors",
        exclude_frozen_parameters: bool = False,
    ):
        from ..checkpoint import save_16bit_model

        return save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    def destroy(self) -> None:
        self.flush_delayed_update()
        self.reducer.remove()
