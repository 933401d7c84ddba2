"""Placement "host": master, exp_avg and exp_avg_sq in host memory; the update is the SIMD host
kernel, one pass per element (16-bit grad in -> fp32 state updated -> 16-bit param out into a
staging buffer), run chunk by chunk so chunk k travels host-to-device while chunk k+1 computes.

When the home is the host param shard (stage 3 with offload_param "cpu"), the kernel writes the
16-bit output there in place and nothing is uploaded; with fp32 params that shard is the master
itself (``AliasState``), which the kernel updates in place.

Delayed update: ``launch`` starts the host pass of step t on a worker thread and returns; the next
``launch`` (or ``flush``) joins it and uploads its params, so forward and backward of step t+1
overlap the host update of step t and run on params one step old.

Ordering (CUDA): the host pass rewrites staging only after the previous uploads from it have run
(``_uploaded``); uploads overwrite params only after the compute stream is done with them (the h2d
stream waits on it).
"""

from __future__ import annotations

import concurrent.futures

import torch

from ....core.labels import HOST_UPDATE, PARAM_H2D, label
from ....core.pinned_bytes import host_bytes
from ....core.streams import alloc_host
from ....kernels.host_adam import host_adam_step
from ..shard_optimizer import ShardOptimizer
from .host_worker import HostWorker


class HostUpdate(ShardOptimizer):
    # The state's chunk buffers are reused by the next read (an NVMe record pool): an fp32
    # upload that reads one must finish before the next chunk is read.
    _reuses_chunk_buffers = False

    def __init__(self, *args, executor: HostWorker | None = None, **kw) -> None:
        super().__init__(*args, **kw)
        group, home, place = self.group, self.home, self.placement
        numel = self.span.numel  # the shard, or a twin's host part (its home is the part's)
        # 16-bit staging for the trip up; fp32 training uploads straight from the master. A host
        # home is written in place by the kernel, except with the delayed update: the next
        # forward gathers from the home while the worker computes, so the worker writes a
        # separate staging buffer that ``flush`` copies over.
        lowp = group.dtype != torch.float32
        in_place = home.host_shard() if lowp and executor is None else None
        # A home on NVMe takes each chunk as it is computed: one chunk of staging suffices.
        self.staging_per_chunk = lowp and home.where == "nvme" and executor is None
        staged = place.chunk if self.staging_per_chunk else numel
        self.staging = (
            in_place
            if in_place is not None
            else (alloc_host(staged, group.dtype, place.pin) if lowp else None)
        )
        self.staging_is_home = in_place is not None
        # One worker thread per engine, shared by its groups: their host passes run one after
        # another with the kernel's full thread count instead of oversubscribing the cores.
        self.executor = executor
        self._pending: concurrent.futures.Future | None = None
        # CUDA: event after the last uploads from ``staging``; the host pass rewrites staging
        # only once they have read it (a delayed pass starts right after flush's uploads).
        self._uploaded = None

    def _apply(self, factor: float) -> None:
        if self.client is not None:
            self._client_step(factor)
        else:
            self._host_pass(self.grads.host_grad(), factor, self._hyper(), upload=True)

    def _client_step(self, factor: float) -> None:
        assert self.client is not None
        grad = self.grads.host_grad()
        grads = [grad[s.shard_start : s.shard_start + s.numel] for s in self.segs]
        self.client.step([(s.shard_start, g) for s, g in zip(self.segs, grads)], factor)
        self._write_home()

    def _write_home(self, source: torch.Tensor | None = None) -> None:
        """The param home becomes ``source``'s values (None: the master's) after an update that
        ran outside the host kernel (a client optimizer's, Muon's, ZenFlow's overlapped one):
        cast into staging, uploaded chunk by chunk on the copy stream, asynchronously."""
        src = self.master if source is None else source
        if self._uploaded is not None:  # the previous async uploads still read staging
            self._uploaded.synchronize()
        self.streams.wait(self.streams.h2d, None)
        for lo, hi in self.chunks:
            if self.staging is not None:  # 16-bit cast (in place when staging is the host home)
                self._staged(lo, hi).copy_(src[lo:hi])
            self._upload(lo, hi, src[lo:hi])
        self._uploaded = self.streams.record(self.streams.h2d)

    # ---- the delayed update --------------------------------------------------------------------
    def launch(self, factor: float) -> None:
        """Delayed update: apply the previous step's params, start this step's host pass."""
        self.flush()
        grad = self.grads.host_grad()
        self.grads.flip()  # the next backward copies into the other host buffer
        self.step_count += 1
        if self.executor is None:
            raise RuntimeError("delayed update needs the engine's host-update executor")
        threads = self.executor.threads  # HostWorker's bound (None: the placement's)
        self._pending = self.executor.submit(
            self._host_pass, grad, factor, self._hyper(), False, threads=threads
        )

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

    # ---- the host pass -------------------------------------------------------------------------
    def _host_pass(
        self,
        grad: torch.Tensor,
        factor: float,
        h: dict,
        upload: bool,
        commit: bool = True,
        threads: int | None = None,
    ) -> None:
        """``threads``: the kernel's thread count (None: the placement's)."""
        if self._uploaded is not None:  # the previous async uploads still read staging
            self._uploaded.synchronize()
            self._uploaded = None
        if upload:  # uploads overwrite params: only after the compute stream is done with them
            self.streams.wait(self.streams.h2d, None)
        body = self._chunk_body(grad, factor, h, upload, threads or self.threads)
        # An NVMe param home's writes must land before the state commits: a failed write is
        # then a failed step (nothing committed), not params that disagree with the master.
        flush = self.home.flush if upload else None
        self.state.update(self.chunks, body, before_commit=flush, commit=commit)
        if upload:
            self._uploaded = self.streams.record(self.streams.h2d)

    def _chunk_body(
        self, grad: torch.Tensor, factor: float, h: dict, upload: bool, threads: int | None
    ):
        """The kernel over one chunk of the state, then (``upload``) its trip to the home."""
        bc = bool(self.group.hyper.get("bias_correction", True))
        # Only a device home's copies run behind the host's back; a host or NVMe home's writes
        # are host copies, done when they return.
        upload_is_async = self.home.where == "device"
        sync_each = (
            self._reuses_chunk_buffers
            and self.staging is None
            and self.streams.cuda
            and upload_is_async
        )

        # An NVMe home lends its write buffer: the kernel's 16-bit output goes there directly.
        direct = upload and self.staging_per_chunk

        def body(lo: int, hi: int, v: dict[str, torch.Tensor]) -> None:
            target = self.home.write_target(lo, hi) if direct else None
            out = target if target is not None else self._staged_or_none(lo, hi)
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
                    threads=threads,
                    **h,
                )
            if target is not None:
                self.home.finish_write()
            elif upload:  # chunk k travels while chunk k+1 computes
                self._upload(lo, hi, v["master"])
                if sync_each:  # fp32 uploads read the chunk buffer, which the next read reuses
                    self.streams.h2d.synchronize()

        return body

    def _upload(self, lo: int, hi: int, master: torch.Tensor) -> None:
        """Shard range ``[lo, hi)`` to the param home: from staging (16-bit), or from
        ``master``, that range of the fp32 master."""
        if self.staging_is_home or self.aliased:  # the kernel wrote the home itself
            return
        src = master if self.staging is None else self._staged(lo, hi)
        st = self.streams
        with label(PARAM_H2D), st.use(st.h2d):
            self.home.write(lo, src, non_blocking=st.cuda)

    def _staged_or_none(self, lo: int, hi: int) -> torch.Tensor | None:
        return None if self.staging is None else self._staged(lo, hi)

    def _staged(self, lo: int, hi: int) -> torch.Tensor:
        """Where the 16-bit output of shard range [lo, hi) is staged."""
        assert self.staging is not None
        return self.staging[: hi - lo] if self.staging_per_chunk else self.staging[lo:hi]

    def nbytes(self) -> dict[str, int]:
        out = super().nbytes()
        if self.staging is not None and not self.staging_is_home:
            out["host.param_staging"] = host_bytes(self.staging)
        return out
