"""Placement "host": master, exp_avg and exp_avg_sq in host memory; the update is the SIMD host
kernel, one pass per element (16-bit grad in -> state updated -> 16-bit param out into the
staging), run chunk by chunk so chunk k travels host-to-device while chunk k+1 computes. The
staging (``staging.py``) is chosen once: none when the master is the params' own dtype, the
home itself when it is a host param shard, one chunk for an NVMe home, else a whole buffer.
The state may live on NVMe (``nvme/optimizer_state.py``): the same chunks, each read from the
swap file ahead of its turn and written back behind it, committed by the transactional runner.

How the update runs in the step (inside it, delayed on the engine's worker, or written in
``stage`` and committed after the ranks agree) is the runner's (``runner.py``).

Ordering (CUDA): the host pass rewrites staging only after the previous uploads from it have run
(``_uploaded``); uploads overwrite params only after the compute stream is done with them (the h2d
stream waits on it).
"""

from __future__ import annotations

import torch

from ....core.labels import HOST_UPDATE, label
from ....kernels.adam_states import adam_step_states, as_cpu_adam_hyper
from ....kernels.host_adam import host_adam_step
from ..shard_optimizer import ShardOptimizer
from .staging import choose_staging


class HostUpdate(ShardOptimizer):
    def __init__(self, *args, delayed: bool = False, **kw) -> None:
        """``delayed``: the runner is the delayed one (its worker writes a staging of its own)."""
        super().__init__(*args, **kw)
        group, place = self.group, self.placement
        self.staging = choose_staging(
            self.home, self.streams, self.span.numel, group.dtype, place,
            self.state.master_dtype, self.aliased, delayed,
        )  # fmt: skip
        # An NVMe record's buffer is reused by the next read: an upload that reads the master
        # (not staging) from a device home must land before the next chunk is read.
        self._sync_each = (
            self.state.transactional
            and self.staging.reads_master
            and not self.aliased
            and self.streams.cuda
            and self.home.where == "device"
        )
        # The kernel, chosen once: the fp32-state kernel, or the compact-state one for a bf16
        # master or bf16 / 8-bit moments (``kernels/adam_states.py``).
        self._kernel = adam_step_states if place.state.compact else host_adam_step
        # CUDA: event after the last uploads from the staging; the host pass rewrites it only
        # once they have read it (a delayed pass starts right after flush's uploads).
        self._uploaded = None

    def adam(self, factor: float, commit: bool = True) -> None:
        self.host_pass(self.grads.host_grad(), factor, self._hyper(), upload=True, commit=commit)

    def grad_views(self) -> list[torch.Tensor]:
        grad = self.grads.host_grad()
        return [grad[s.shard_start : s.shard_start + s.numel] for s in self.segs]

    def write_home(self, source: torch.Tensor | None = None) -> None:
        """The param home becomes ``source``'s values (None: the master's) after an update that
        ran outside the host kernel (a client optimizer's, Muon's, ZenFlow's overlapped one):
        through the staging, chunk by chunk on the copy stream, asynchronously."""
        src = self.master if source is None else source
        self._wait_uploads()
        self.streams.wait(self.streams.h2d, None)
        for lo, hi in self.chunks:
            self.staging.put(lo, hi, src[lo:hi])
        self._uploaded = self.streams.record(self.streams.h2d)

    def send_all(self) -> None:
        """Every chunk's 16-bit values (written by a delayed pass) to the home."""
        self.streams.wait(self.streams.h2d, None)
        for lo, hi in self.chunks:
            self.staging.send(lo, hi, self.master[lo:hi])
        self._uploaded = self.streams.record(self.streams.h2d)

    def _wait_uploads(self) -> None:
        if self._uploaded is not None:  # the previous async uploads still read staging
            self._uploaded.synchronize()
            self._uploaded = None

    # ---- the host pass -------------------------------------------------------------------------
    def host_pass(
        self,
        grad: torch.Tensor,
        factor: float,
        h: dict,
        upload: bool,
        commit: bool = True,
        threads: int | None = None,
    ) -> None:
        """The kernel over every chunk; ``upload``: each chunk then to the home (False: the
        delayed pass, whose chunks ``send_all`` sends); ``threads``: None: the placement's."""
        self._wait_uploads()
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
        if self.placement.state.compact:  # DeepSpeed's CPU Adam's fp32 hyperparameters
            h = as_cpu_adam_hyper(h)
        staging, sync_each = self.staging, self._sync_each
        kernel, step = self._kernel, self.step_count

        def body(lo: int, hi: int, v: dict[str, torch.Tensor]) -> None:
            with label(HOST_UPDATE):
                kernel(
                    v["master"],
                    v["exp_avg"],
                    v["exp_avg_sq"],
                    grad[lo:hi],
                    staging.out(lo, hi),
                    step=step,
                    adamw=self.adamw,
                    bias_correction=bc,
                    grad_scale=factor,
                    threads=threads,
                    **self._state_options(lo, step),
                    **h,
                )
            if upload:  # chunk k travels while chunk k+1 computes
                staging.send(lo, hi, v["master"])
                if sync_each:  # the upload reads the chunk buffer, which the next read reuses
                    self.streams.h2d.synchronize()

        return body

    def nbytes(self) -> dict[str, int]:
        out = super().nbytes()
        out.update(self.staging.nbytes())
        return out
