"""One flat group's update: the interface every placement's update path implements.

A ``ShardOptimizer`` owns the group's master shard and Adam moments (its ``ShardState``) and
writes the updated 16-bit values to the group's param home (``param_home.py``): this rank's
slices of the flat buffer, all-gathered per bucket (stages 0-2), or its param shard (stage 3).
Each placement of the optimizer state is one class:

- ``DeviceUpdate`` (``device_update.py``): state on the accelerator, torch's fused Adam(W);
- ``HostUpdate`` (``host_update.py``): state in host memory, the SIMD host kernel chunk by chunk,
  chunk k travelling host-to-device while chunk k+1 computes; the delayed update;
- ``NvmeUpdate`` (``nvme_update.py``): the host kernel over chunks streamed from a swap file,
  written in ``stage`` and then committed or rolled back for every group of every rank.

A client optimizer that is not Adam(W) (``client_update.py``) replaces the Adam math on the
device and host paths: it runs over the master shard where it lives.

The step protocol (every placement; the engine drives it through ``OptimizerGroup``):
``stage(factor)``, then ``commit()`` or ``rollback()``. Here ``stage`` keeps the factor and the
update runs in ``commit``, so a rollback has nothing to undo; a placement whose update can fail
part way (NVMe: a failed write) does the work in ``stage`` (``stage_writes``), and the engine
agrees across ranks before any group commits.

Invariant: ``step_count`` is the number of committed updates; a step that raises leaves it (and
an NVMe state) at the last committed step.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ...core.flat_group import FlatGroup
from ...core.state.shard_state import ShardState
from ...core.state.torn import TornStateError
from ...core.streams import Streams
from ..reduce.grad_shard import GradShard
from .buffers import StateBuffer
from .param_home import ParamHome
from .part import PartHome, Span
from .paths.client_update import ClientUpdate
from .placement import Placement


@dataclass(frozen=True)
class UpdatePolicy:
    """What the update of one group needs to know besides its buffers."""

    sharded: bool  # stages 1-3: this rank updates its partition only
    adamw: bool
    placement: Placement


class ShardOptimizer:
    """The update of one group; subclasses implement ``_apply`` for their placement."""

    def __init__(
        self,
        group: FlatGroup,
        grad_shard: GradShard,
        home: ParamHome,
        state: ShardState,
        policy: UpdatePolicy,
        streams: Streams,
        client: torch.optim.Optimizer | None = None,
        span: Span | None = None,
    ) -> None:
        """``state``: the master shard and moments, built for ``policy.placement.optimizer`` and
        still empty; they are filled here from the param home's 16-bit values. ``span``: the
        part of the shard this update owns (a twin's part, see part.py); None: all of it."""
        place = policy.placement
        self.placement, self.sharded = place, policy.sharded
        whole = Span(0, group.shard_numel(self.sharded))
        self.span = span or whole
        if self.span != whole:  # every coordinate below is the span's own
            home = PartHome(home, self.span)
        self.group, self.grads, self.home, self.state = group, grad_shard, home, state
        self.adamw, self.streams, self.threads = policy.adamw, streams, place.threads
        self.segs = self.span.clip(group.segments(self.sharded))
        numel = self.span.numel
        # Chunks: contiguous ranges of the shard index space, the host update's unit of work
        # (an NVMe state's record); the param home maps one onto the segments it covers.
        self.chunks = [(lo, min(lo + place.chunk, numel)) for lo in range(0, numel, place.chunk)]
        # the initial state: master from the home's 16-bit values (an aliased one is them)
        self.state.fill(lambda lo, hi, out: out.copy_(self.home.read(lo, hi)))
        self.client = ClientUpdate(client, group.hyper, state.master) if client else None
        self.step_count = 0
        self._staged_step: tuple[float, bool] | None = None  # (factor, delayed) until commit
        # Why the state no longer is one committed step (a commit that failed part way, an
        # overlapped update that failed): then no step and no save runs until a load.
        self.torn: str | None = None

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

    @property
    def aliased(self) -> bool:
        """The master is the param home's own fp32 values (``core/state/alias_state.py``)."""
        return self.state.aliased

    def master_from_params(self) -> None:
        """The master becomes the param home's 16-bit values (padding: zero); the moments are
        kept. An aliased master already is them."""
        if self.aliased:
            return
        self.state.update(self.chunks, lambda lo, hi, v: v["master"].copy_(self.home.read(lo, hi)))

    def device_buffers(self) -> Iterator[StateBuffer]:
        """Device buffers of the update's own beyond the shard state (ZenFlow's selected
        columns' moments), for ``offload_states`` and the memory report; none for the others."""
        return iter(())

    def extra_state(self) -> dict[str, torch.Tensor]:
        """State of the update's own saved beside the shard (ZenFlow's mid-interval state),
        name -> tensor; none for the built-in paths."""
        return {}

    def load_extra_state(self, fetch) -> None:
        """``extra_state`` back from a checkpoint (``fetch(name)``: None where absent)."""

    def check_extra_state(self, fetch, step_count: int, same_world: bool) -> None:
        """Refuse (``ValueError`` naming the tensor) saved extra state this update cannot
        continue from; checked before anything is loaded. None saved by the built-in paths."""

    def extra_digest(self, fetch) -> torch.Tensor | None:
        """What the ranks' saved extra state must agree on (compared before the load)."""
        return None

    def params_from_master(self) -> None:
        """The param home becomes the master's cast, as after a step (checkpoint load)."""
        self.restore_params()
        self.home.publish()

    def restore_params(self) -> None:
        """This rank's own 16-bit slices become the committed master's cast again (an aliased
        master is those slices)."""
        if self.aliased:
            return
        self.state.update(
            self.chunks, lambda lo, hi, v: self.home.write(lo, v["master"]), write=False
        )
        self.home.flush()

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

    # The fragment API's optimizer-state keys -> the shard state's kinds (Muon: its momentum).
    STATE_KEYS: dict[str, str] = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}

    def close(self) -> None:
        """The update's resources released (a swap file removed, a running host update
        finished); ``engine.destroy`` calls it once per group."""
        self.state.close()

    # ---- the step protocol ---------------------------------------------------------------------
    # Set by a placement whose ``stage`` writes the update (and may fail part way): the engine
    # then agrees across ranks, once, before any group commits.
    stage_writes = False

    def stage(self, factor: float, delayed: bool = False) -> None:
        """This step's update, ready to commit: the factor kept (``delayed``: commit starts the
        delayed update instead of a synchronous one); nothing is written yet."""
        self.check_intact()
        self._staged_step = (factor, delayed)

    def commit(self) -> None:
        """The staged update applied (nothing staged: nothing to do)."""
        staged, self._staged_step = self._staged_step, None
        if staged is None:
            return
        factor, delayed = staged
        if delayed:
            self.launch(factor)
        else:
            self._synchronous(factor)

    def rollback(self) -> None:
        """The staged update forgotten: state, step count and params are the last committed
        step's (nothing was written)."""
        self._staged_step = None

    def launch(self, factor: float) -> None:
        """Start a delayed update (the host placement's, ``host_update.py``)."""
        raise RuntimeError("the delayed update runs on the host placement only")

    def tear(self, reason: str) -> None:
        """The state is not one committed step any more (``reason`` says why): every later
        step and save is refused until a checkpoint is loaded (``mend``)."""
        self.torn = self.torn or reason

    def mend(self) -> None:
        """A checkpoint's state was loaded over the torn one."""
        self.torn = None

    def check_intact(self) -> None:
        if self.torn is not None:
            raise TornStateError(self.torn)

    # ---- the step ------------------------------------------------------------------------------
    def step(self, factor: float) -> None:
        """One synchronous update with the combined grad factor (unscale x clip): the protocol's
        stage and commit, back to back."""
        self.stage(factor)
        self.commit()

    def _synchronous(self, factor: float) -> None:
        self.flush()
        self.home.prepare_write()
        self.step_count += 1
        try:
            self._apply(factor)
        except BaseException:
            self.step_count -= 1  # nothing committed (an NVMe state keeps its last step)
            raise
        self.home.publish()

    def _apply(self, factor: float) -> None:
        """This placement's update of the master, moments and param home."""
        raise NotImplementedError

    def flush(self) -> None:
        """Apply a pending (delayed) update; only the host path has one."""

    def prepare_update(self) -> None:
        """The backward that ends an accumulation window began (the update follows it); only
        the NVMe path has work to start early."""

    def nbytes(self) -> dict[str, int]:
        out = self.state.nbytes()
        if self.client is not None:
            out[f"{self.state.where}.optimizer_state"] = self.client.state_nbytes()
        return out
