"""One flat group's update: the step protocol every placement's update implements, composed of
parts chosen once when the group is built (``group.build_shard_optimizer``):

- the **state kind** (``core/state/``): where and how the master and moments are kept (device or
  host memory, an alias of the params, a twin's two parts, a swap file), its capabilities
  declared on its type (``aliased``, ``transactional``, ``parts``, ``close``);
- the **rule** (``rules.py``): what the update computes (Adam(W) by the placement's kernel, a
  client optimizer, Muon), over the state where it lives;
- the **placement's update** (this class's subclasses): ``DeviceUpdate`` (``device_update.py``,
  torch's fused Adam on the accelerator) or ``HostUpdate`` (``host_update.py``, the SIMD host
  kernel chunk by chunk, with its **staging** chosen once, ``staging.py``); ``TwinUpdate`` is
  one of each over the two parts of a shard;
- the **runner** (``runner.py``): synchronous, delayed on the engine's worker, or transactional
  (a state that declares it: NVMe).

The step protocol (every placement; the engine drives it through ``OptimizerGroup``):
``stage(factor)``, then ``commit()`` or ``rollback()``, each the runner's. ZenFlow
(``zenflow/``) runs its own protocol over the host update.

Invariant: ``step_count`` is the number of committed updates; a step that raises leaves it (and
an NVMe state) at the last committed step.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ...core.flat_group import FlatGroup
from ...core.state.format import FP32, format_of, format_tensor
from ...core.state.shard_state import ShardState
from ...core.state.torn import TornStateError
from ...core.streams import Streams
from ...kernels.adam_states import StateOptions
from ..reduce.grad_shard import GradShard
from .buffers import StateBuffer
from .param_home import ParamHome
from .part import PartHome, Span
from .paths.client_update import ClientUpdate
from .placement import Placement
from .rules import AdamRule, Rule
from .runner import Runner, Synchronous


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
        rule: Rule | None = None,
        runner: Runner | None = None,
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
        self.rule: Rule = rule or AdamRule()
        self.step_count = 0
        # Why the state no longer is one committed step (a commit that failed part way, an
        # overlapped update that failed): then no step and no save runs until a load.
        self.torn: str | None = None
        self.runner: Runner = runner or Synchronous()
        self.runner.bind(self)

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
        """Device buffers of the runner's own beyond the shard state (ZenFlow's selected
        columns' moments), for ``offload_states`` and the memory report; none for the others."""
        return self.runner.device_buffers()

    def extra_state(self) -> dict[str, torch.Tensor]:
        """State saved beside the shard's fp32 tensors: a compact format's record and the
        stored tensors its fp32 does not give back exactly (8-bit codes and scales); none in
        fp32. (ZenFlow adds its mid-interval state.)"""
        out = self.runner.extra_state()
        fmt = self.placement.state
        if fmt.compact:
            out.update(state_format=format_tensor(fmt, self._where()), **self.state.raw())
        return out

    def _where(self) -> tuple[int, int, int]:
        """This shard's partition: world size, rank, numel."""
        return (self.group.layout.world_size, self.group.rank, self.state.numel)

    def load_extra_state(self, fetch) -> None:
        """``extra_state`` back from a checkpoint (``fetch(name)``: None where absent). The
        fp32 tensors were loaded already (converted to this run's format); a checkpoint of the
        same format and partition then gives back its stored tensors, so the resume is
        bitwise; one of another format was converted, with a warning naming both."""
        saved = fetch("state_format")
        theirs, where = format_of(saved) if saved is not None else (FP32, None)
        mine = self.placement.state
        if not theirs.same_storage(mine):
            warnings.warn(
                f"param group {self.group.index}: the checkpoint's optimizer state is "
                f"{theirs.name}, this run keeps {mine.name}: converted on load",
                stacklevel=2,
            )
        elif where == self._where():
            self.state.load_raw(fetch)
        self.runner.load_extra_state(fetch)

    def check_extra_state(self, fetch, step_count: int, same_world: bool) -> None:
        """Refuse (``ValueError`` naming the tensor) saved extra state this update cannot
        continue from; checked before anything is loaded (the runner's: ZenFlow's)."""
        self.runner.check_extra_state(fetch, step_count, same_world)

    def extra_digest(self, fetch) -> torch.Tensor | None:
        """What the ranks' saved extra state must agree on (compared before the load)."""
        return self.runner.extra_digest(fetch)

    def params_from_master(self) -> None:
        """The param home becomes the master's cast, as after a step (checkpoint load), unless
        the runner restores the params the checkpoint's run had (ZenFlow's overlap)."""
        if self.runner.params_after_load():
            return
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

    def _state_options(self, lo: int, step: int) -> dict:
        """The compact-state update's options for the chunk at ``lo`` (host kernel or device
        reference alike): stochastic rounding of a bf16 master seeded per run and step, each
        element drawing by its place in the group's flat partition (so neither a chunking nor
        the placement changes the draws)."""
        fmt = self.placement.state
        if not fmt.compact:
            return {}
        seed = fmt.seed if fmt.stochastic_round else None
        offset = self.group.rank * self.group.shard_numel(self.sharded) + self.span.lo + lo
        return {"options": StateOptions(stochastic_round_seed=seed, index_offset=offset)}

    @property
    def STATE_KEYS(self) -> dict[str, str]:  # noqa: N802 (the fragment API's table)
        """The fragment API's optimizer-state keys -> the shard state's kinds (the rule's)."""
        return self.rule.STATE_KEYS

    def close(self) -> None:
        """The update's resources released (a swap file removed, a running host update
        finished); ``engine.destroy`` calls it once per group."""
        self.runner.close()
        self.state.close()

    # ---- the step protocol: the runner's -------------------------------------------------------
    @property
    def stage_writes(self) -> bool:
        """``stage`` writes the update (and may fail part way): the engine then agrees across
        ranks, once, before any group commits."""
        return self.runner.stage_writes

    def stage(self, factor: float, delayed: bool = False) -> None:
        """This step's update, ready to commit (``delayed``: the delayed runner starts it
        behind the next step)."""
        self.check_intact()
        self.runner.stage(self, factor, delayed)

    def commit(self) -> None:
        self.runner.commit(self)

    def rollback(self) -> None:
        """The staged update forgotten: state, step count and params are the last committed
        step's."""
        self.runner.rollback(self)

    def flush(self) -> None:
        """Apply a pending (delayed) update, if any."""
        self.runner.flush(self)

    def prepare_update(self) -> None:
        """The backward that ends an accumulation window began (the update follows it)."""
        self.runner.prepare(self)

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

    def run(self, factor: float) -> None:
        """The update inside the step, committed and published."""
        self.home.prepare_write()
        self.step_count += 1
        try:
            self.apply(factor)
        except BaseException:
            self.step_count -= 1  # nothing committed
            raise
        self.home.publish()

    def apply(self, factor: float, commit: bool = True) -> None:
        """The rule's update of the master, moments and param home (``commit`` False: a
        transactional state keeps it pending)."""
        self.rule.apply(self, factor, commit)

    # What each placement gives the rules: Adam by its own kernel; a whole-shard rule's inputs
    # (each segment's reduced gradient and master view) and the home's refresh after it.
    def adam(self, factor: float, commit: bool = True) -> None:
        raise NotImplementedError

    def grad_views(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def master_views(self) -> list[torch.Tensor]:
        if self.aliased:
            return self.state.views("master", self.segs)  # type: ignore[attr-defined]
        return [self.master[s.shard_start : s.shard_start + s.numel] for s in self.segs]

    def write_home(self) -> None:
        raise NotImplementedError

    def nbytes(self) -> dict[str, int]:
        out = self.state.nbytes()
        if self.client is not None:
            out[f"{self.state.where}.optimizer_state"] = self.client.state_nbytes()
        for k, v in self.runner.nbytes().items():
            out[k] = out.get(k, 0) + v
        return out
