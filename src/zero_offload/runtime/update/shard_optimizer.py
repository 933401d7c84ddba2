"""The master shard of one flat group, its Adam state, and the update path.

placement "device": master, exp_avg, exp_avg_sq on the accelerator; the step is torch's fused
Adam(W) over this rank's segments. placement "host": they live in host memory and the step is the
host kernel, one pass per element (16-bit grad in -> fp32 state updated -> 16-bit param out into a
staging buffer), run chunk by chunk so chunk k travels host-to-device while chunk k+1 computes.
placement "nvme": the same kernel over the same chunks, each read from the rank's swap file into
a pool buffer ahead of its turn and written back behind it (``nvme/optimizer_state.py``); the
state (``shard_state.py``) hides where the chunk came from.

Either way the updated 16-bit slices land in the param home (param_home.py): this rank's slices
of the flat buffer, all-gathered per bucket (stages 0-2), or its param shard (stage 3). When the
home is the host param shard (stage 3 with offload_param and offload_optimizer), the host kernel
writes the 16-bit output there in place and nothing is uploaded.

A client optimizer that is not Adam(W) (``client_update.py``) replaces the Adam math: it runs
over the master shard where it lives, and the 16-bit output takes the same way home.

Delayed update (host only): ``launch`` starts the host pass of step t on a worker thread and
returns; the next ``launch`` (or ``flush``) joins it and uploads its params, so forward and backward
of step t+1 overlap the host update of step t and run on params one step old.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass

import torch

from ...core.flat_group import FlatGroup
from ...core.labels import HOST_UPDATE, PARAM_H2D, label
from ...core.shard_state import ShardState
from ...core.streams import Streams, alloc_host
from ...kernels.host_adam import host_adam_step
from ..reduce.grad_shard import GradShard
from .client_update import ClientUpdate
from .param_home import ParamHome
from .placement import Placement


@dataclass(frozen=True)
class UpdatePolicy:
    """What the update of one group needs to know besides its buffers."""

    sharded: bool  # stages 1-3: this rank updates its partition only
    adamw: bool
    placement: Placement


class ShardOptimizer:
    def __init__(
        self,
        group: FlatGroup,
        grad_shard: GradShard,
        home: ParamHome,
        state: ShardState,
        policy: UpdatePolicy,
        streams: Streams,
        executor: concurrent.futures.Executor | None = None,
        client: torch.optim.Optimizer | None = None,
    ) -> None:
        """``state``: the master shard and moments, built for ``policy.placement.optimizer`` and
        still empty; they are filled here from the param home's 16-bit values."""
        self.group, self.grads, self.home, self.state = group, grad_shard, home, state
        place = policy.placement
        self.sharded, self.host = policy.sharded, place.host_update
        self.adamw, self.streams, self.threads = policy.adamw, streams, place.threads
        self.nvme = place.optimizer == "nvme"
        self.segs = group.segments(self.sharded)
        numel = group.shard_numel(self.sharded)
        # Chunks: contiguous ranges of the shard index space, the host update's unit of work
        # (an NVMe state's record); the param home maps one onto the segments it covers.
        self.chunks = [(lo, min(lo + place.chunk, numel)) for lo in range(0, numel, place.chunk)]
        self.master_from_params(initial=True)
        self.client = ClientUpdate(client, group.hyper, state.master) if client else None
        self.step_count = 0
        self._pending_commit = False  # an NVMe update is written and waits for commit or discard
        # 16-bit staging for the trip up; fp32 training uploads straight from the master. A host
        # home is written in place by the kernel, except with the delayed update: the next
        # forward gathers from the home while the worker computes, so the worker writes a
        # separate staging buffer that ``flush`` copies over.
        lowp = group.dtype != torch.float32
        in_place = home.host_shard() if self.host and lowp and executor is None else None
        # A home on NVMe takes each chunk as it is computed: one chunk of staging suffices.
        self.staging_per_chunk = self.host and lowp and home.on_nvme and executor is None
        staged = place.chunk if self.staging_per_chunk else numel
        self.staging = (
            in_place
            if in_place is not None
            else (alloc_host(staged, group.dtype, place.pin) if self.host and lowp else None)
        )
        self.staging_is_home = in_place is not None
        # One worker thread per engine, shared by its groups: their host passes run one after
        # another with the kernel's full thread count instead of oversubscribing the cores.
        self.executor = executor
        self._pending: concurrent.futures.Future | None = None
        # CUDA: event after the last uploads from ``staging``; the host pass rewrites staging
        # only once they have read it (a delayed pass starts right after flush's uploads).
        self._uploaded = None

    @property
    def master(self) -> torch.Tensor:
        """The fp32 master shard as one tensor (device or host placement only; an NVMe state
        is read through ``state.read``)."""
        return self.state.master

    @property
    def exp_avg(self) -> torch.Tensor:
        return self.state.exp_avg

    @property
    def exp_avg_sq(self) -> torch.Tensor:
        return self.state.exp_avg_sq

    def master_from_params(self, initial: bool = False) -> None:
        """The master becomes the param home's 16-bit values (padding: zero); the moments are
        kept (``initial``: an NVMe state's files are written whole, moments zero)."""

        def fill(lo: int, hi: int, out: torch.Tensor) -> None:
            out.copy_(self.home.read(lo, hi))

        if self.nvme and initial:
            self.state.fill(fill)
        else:
            self.state.update(self.chunks, lambda lo, hi, v: fill(lo, hi, v["master"]))

    def params_from_master(self) -> None:
        """The param home becomes the master's cast, as after a step (checkpoint load)."""
        self.restore_params()
        self.home.publish()

    def _hyper(self) -> dict:
        h = self.group.hyper
        b1, b2 = h["betas"]
        return dict(
            lr=float(h["lr"]),
            beta1=float(b1),
            beta2=float(b2),
            eps=float(h["eps"]),
            weight_decay=float(h["weight_decay"]),
        )

    # ---- the step ------------------------------------------------------------------------------
    def step(self, factor: float) -> None:
        """One synchronous update with the combined grad factor (unscale x clip)."""
        self.flush()
        self.home.prepare_write()
        self.step_count += 1
        try:
            if self.client is not None:
                self._client_step(factor)
            elif self.host:
                self._host_pass(self.grads.host_grad(), factor, self._hyper(), upload=True)
            else:
                self._device_step(factor)
        except BaseException:
            self.step_count -= 1  # nothing committed (an NVMe state keeps its last step)
            raise
        self.home.publish()

    # ---- the NVMe step: every group and every rank, or nothing ----------------------------------
    def stage(self, factor: float) -> None:
        """NVMe state: this step's update written, not committed, not published (no collective
        here, so a rank that fails does not leave others waiting); then ``commit`` or
        ``discard`` + ``restore_params``, as the engine decides for every group of every rank."""
        self.flush()
        self.home.prepare_write()
        self.step_count += 1
        self._pending_commit = True
        try:
            self._host_pass(
                self.grads.host_grad(), factor, self._hyper(), upload=True, commit=False
            )
        finally:
            if self.streams.cuda:  # the uploads already queued land before anything else
                self.streams.h2d.synchronize()

    def commit(self) -> None:
        self.state.commit()
        self._pending_commit = False
        self.home.publish()

    def discard(self) -> None:
        """Forget a staged update (none staged: nothing to do): the state and the step count are
        the last committed step's. The params may still hold some of its chunks."""
        if self._pending_commit:
            self.state.discard()
            self.step_count -= 1
            self._pending_commit = False

    def restore_params(self) -> None:
        """This rank's own 16-bit slices become the committed master's cast again (some chunks
        of a discarded update were already uploaded). Local: nothing was gathered since, so the
        other ranks' slices and every gathered copy still hold the committed values."""
        self.state.update(
            self.chunks, lambda lo, hi, v: self.home.write(lo, v["master"]), write=False
        )
        self.home.flush()

    def _client_step(self, factor: float) -> None:
        assert self.client is not None
        if self.host:
            grad = self.grads.host_grad()
            grads = [grad[s.shard_start : s.shard_start + s.numel] for s in self.segs]
        else:
            grads = self.grads.device_grads()
        self.client.step([(s.shard_start, g) for s, g in zip(self.segs, grads)], factor)
        if not self.host:
            self.home.write(0, self.master)  # the master covers the whole shard
            return
        if self._uploaded is not None:  # the previous async uploads still read staging
            self._uploaded.synchronize()
        self.streams.wait(self.streams.h2d, None)
        for lo, hi in self.chunks:
            if self.staging is not None:  # 16-bit cast (in place when staging is the host home)
                self._staged(lo, hi).copy_(self.master[lo:hi])
            self._upload(lo, hi, self.master[lo:hi])
        self._uploaded = self.streams.record(self.streams.h2d)

    def launch(self, factor: float) -> None:
        """Delayed update: apply the previous step's params, start this step's host pass."""
        self.flush()
        grad = self.grads.host_grad()
        self.grads.flip()  # the next backward copies into the other host buffer
        self.step_count += 1
        if self.executor is None:
            raise RuntimeError("delayed update needs the engine's host-update executor")
        self._pending = self.executor.submit(self._host_pass, grad, factor, self._hyper(), False)

    def flush(self) -> None:
        """Join a delayed host pass, if any, and upload + gather its params."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        pending.result()  # re-raises a failure of the host pass here, on the main thread
        self.home.prepare_write()
        self.streams.wait(self.streams.h2d, None)
        for lo, hi in self.chunks:
            self._upload(lo, hi, self.master[lo:hi])
        self._uploaded = self.streams.record(self.streams.h2d)
        self.home.publish()

    # ---- device placement ----------------------------------------------------------------------
    def _device_step(self, factor: float) -> None:
        h = self._hyper()
        grads = [g if g.dtype == torch.float32 else g.float() for g in self.grads.device_grads()]
        torch._foreach_mul_(grads, factor)  # fp32 grads are this rank's own, consumed here
        views = lambda t: [t[s.shard_start : s.shard_start + s.numel] for s in self.segs]  # noqa: E731
        p, m, v = views(self.master), views(self.state.exp_avg), views(self.state.exp_avg_sq)
        if self.group.hyper.get("bias_correction", True):
            # One step tensor filled on the device, shared by every segment (the fused kernel
            # only reads it): no host-to-device copy per segment per step.
            step = torch.full((), float(self.step_count), device=self.master.device)
            steps = [step] * len(p)
            fused = torch._fused_adamw_ if self.adamw else torch._fused_adam_
            fused(
                p,
                grads,
                m,
                v,
                [],
                steps,
                lr=h["lr"],
                beta1=h["beta1"],
                beta2=h["beta2"],
                weight_decay=h["weight_decay"],
                eps=h["eps"],
                amsgrad=False,
                maximize=False,
            )
        else:
            _adam_no_bias_correction(p, grads, m, v, self.adamw, **h)
        self.home.write(0, self.master)  # p are views of it: the whole shard, one call

    # ---- host placement ------------------------------------------------------------------------
    def _host_pass(
        self, grad: torch.Tensor, factor: float, h: dict, upload: bool, commit: bool = True
    ) -> None:
        bc = bool(self.group.hyper.get("bias_correction", True))
        if self._uploaded is not None:  # the previous async uploads still read staging
            self._uploaded.synchronize()
            self._uploaded = None
        if upload:  # uploads overwrite params: only after the compute stream is done with them
            self.streams.wait(self.streams.h2d, None)

        # Only a device home's copies run behind the host's back; a host or NVMe home's writes
        # are host copies, done when they return.
        upload_is_async = not (self.home.on_host or self.home.on_nvme)

        def body(lo: int, hi: int, v: dict[str, torch.Tensor]) -> None:
            out = None if self.staging is None else self._staged(lo, hi)
            with label(HOST_UPDATE):
                host_adam_step(
                    v["master"],
                    v["exp_avg"],
                    v["exp_avg_sq"],
                    grad[lo:hi],
                    out,
                    step=self.step_count,
                    adamw=self.adamw,
                    bias_correction=bc,
                    grad_scale=factor,
                    threads=self.threads,
                    **h,
                )
            if upload:  # chunk k travels while chunk k+1 computes
                self._upload(lo, hi, v["master"])
                if self.nvme and self.staging is None and self.streams.cuda and upload_is_async:
                    # fp32 uploads read the NVMe record buffer, which the next read reuses
                    self.streams.h2d.synchronize()

        # An NVMe param home's writes must land before the state commits: a failed write is
        # then a failed step (nothing committed), not params that disagree with the master.
        flush = self.home.flush if upload else None
        self.state.update(self.chunks, body, before_commit=flush, commit=commit)
        if upload:
            self._uploaded = self.streams.record(self.streams.h2d)

    def _upload(self, lo: int, hi: int, master: torch.Tensor) -> None:
        """Shard range ``[lo, hi)`` to the param home: from staging (16-bit), or from
        ``master``, that range of the fp32 master."""
        if self.staging_is_home:  # the kernel wrote the home itself
            return
        src = master if self.staging is None else self._staged(lo, hi)
        st = self.streams
        with label(PARAM_H2D), st.use(st.h2d):
            self.home.write(lo, src, non_blocking=st.cuda)

    def _staged(self, lo: int, hi: int) -> torch.Tensor:
        """Where the 16-bit output of shard range [lo, hi) is staged."""
        assert self.staging is not None
        return self.staging[: hi - lo] if self.staging_per_chunk else self.staging[lo:hi]

    def nbytes(self) -> dict[str, int]:
        out = self.state.nbytes()
        if self.client is not None:
            out[f"{self.state.where}.optimizer_state"] = self.client.state_nbytes()
        if self.staging is not None and not self.staging_is_home:
            out["host.param_staging"] = self.staging.numel() * self.staging.element_size()
        return out


def _adam_no_bias_correction(p, g, m, v, adamw, lr, beta1, beta2, eps, weight_decay) -> None:
    """Adam(W) without bias correction (DeepSpeed's ``bias_correction: false``)."""
    if weight_decay and adamw:
        torch._foreach_mul_(p, 1.0 - lr * weight_decay)
    elif weight_decay:
        g = torch._foreach_add(g, p, alpha=weight_decay)
    torch._foreach_lerp_(m, g, 1.0 - beta1)
    torch._foreach_mul_(v, beta2)
    torch._foreach_addcmul_(v, g, g, value=1.0 - beta2)
    denom = torch._foreach_add(torch._foreach_sqrt(v), eps)
    torch._foreach_addcdiv_(p, m, denom, value=-lr)
