"""One optimizer param group as one object: its flat group, gradient shard, param home, shard
optimizer (which owns the shard state) and the placement they were built for.

The engine, the checkpoint code and the tensor-fragment API iterate these objects; the index
``index`` is the group's position in the optimizer's ``param_groups`` and in a checkpoint.

The group owns its step, one protocol for every placement (``group_step.py`` runs it over all
groups): ``prepare`` when the backward that ends a window begins, ``stage(factor, step)``, then
``commit`` or ``rollback``; ``skip`` for a step that overflowed. Which update path runs, and
whether it is the delayed one, is the group's business: the engine never asks its placement.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ...core.flat_group import FlatGroup
from ...core.state.shard_state import ShardState
from ...core.streams import Streams
from ...kernels.quant_maps import QuantizedMoment
from ...kernels.sumsq import sum_of_squares
from ...nvme.state_range import StateRange
from ..reduce.grad_shard import GradShard
from .buffers import OffloadStateType, StateBuffer
from .group_state import GroupLoad, GroupSave, grad_source, state_source, state_tensor
from .muon.muon_update import MuonRule
from .param_home import ParamHome
from .paths.device_update import DeviceUpdate
from .paths.host_update import HostUpdate
from .paths.host_worker import HostWorker
from .paths.twin_update import TwinUpdate
from .placement import Placement
from .rules import AdamRule, ClientRule, Rule
from .runner import choose_runner
from .shard_optimizer import ShardOptimizer, UpdatePolicy


@dataclass(frozen=True)
class OptimizerGroup:
    flat: FlatGroup
    grads: GradShard
    home: ParamHome
    optimizer: ShardOptimizer
    placement: Placement

    @property
    def index(self) -> int:
        return self.flat.index

    @property
    def state(self) -> ShardState:
        """The master shard and moments (where ``placement.optimizer`` says)."""
        return self.optimizer.state

    # ---- its buffers ---------------------------------------------------------------------------
    @property
    def master_is_params(self) -> bool:
        """The master on the device is the params' own fp32 values (``core/state/alias_state.py``):
        it moves with the params, which the param store or flat buffer own."""
        return any(p.aliased for p in self._device_states())

    def _device_states(self) -> list:
        """The device-resident parts of the shard state (a twin's device part)."""
        return [s for s in self.state.parts() if s.where == "device"]

    def nbytes(self) -> dict[str, int]:
        """Bytes held per memory-report category: the gradient shard's and the update's."""
        out = dict(self.grads.nbytes())
        for k, v in self.optimizer.nbytes().items():
            out[k] = out.get(k, 0) + v
        return out

    def buffers(self) -> Iterator[StateBuffer]:
        """The group's own device buffers, each with its offloadable state: Adam's moments
        (Muon's momentum) and a client optimizer's state, the master unless it is the params,
        the gradient buffers."""
        opt, grads = OffloadStateType.optim_states, OffloadStateType.lp_grads
        parts = self._device_states()
        for part in parts:
            for t in (part.exp_avg, part.exp_avg_sq):
                # Muon's momentum state has no second moment; an 8-bit moment is two tensors
                pieces = (t.codes, t.scales) if isinstance(t, QuantizedMoment) else (t,)
                for x in pieces if t is not None else ():
                    yield StateBuffer(x, "device.optimizer_state", state=opt)
        yield from self.optimizer.device_buffers()  # the update's own (ZenFlow's columns)
        client = self.optimizer.client
        if client is not None and parts:  # it runs where the master lives: on the device
            for v in client.optimizer.state[client.param].values():
                if isinstance(v, torch.Tensor) and v.device == client.param.device:
                    yield StateBuffer(v, None, state=opt)
            yield StateBuffer(client.grad, None, keep=False, state=opt)  # rewritten every step
        for part in parts:
            if not part.aliased:
                yield StateBuffer(
                    part.master, "device.master_shard", state=OffloadStateType.hp_params
                )
        g = self.grads
        named = (
            (g.flat_grad, "device.grads"),
            (g.accum, "device.grad_accum"),
            (g.device_shard, "device.grad_shard"),
        )
        for t, category in named:
            if t is not None:
                yield StateBuffer(t, category, state=grads)

    def state_buffers(self, state: OffloadStateType) -> Iterator[StateBuffer]:
        """The group's device buffers of DeepSpeed's offloadable ``state`` (what
        ``offload_states`` moves): its own ``buffers()``, and its params on the device
        (``lp_params``), which are also the master where the master is the params."""
        params = self.home.device_params()
        if state is OffloadStateType.lp_params:
            if params is not None:
                yield StateBuffer(*params, state=state)
            return
        if state is OffloadStateType.hp_params and self.master_is_params:
            also = frozenset({OffloadStateType.lp_params})  # one storage: they move as one
            yield StateBuffer(*params, also=also, state=state)
            return
        yield from (b for b in self.buffers() if b.state is state)

    # ---- its saved state and fragments (checkpoints, the tensor-fragment API) ------------------
    def save(self) -> GroupSave:
        """What a checkpoint keeps of the group; refused while the state is torn."""
        so = self.optimizer
        so.check_intact()
        return GroupSave(
            self.flat, so.segs, bool(so.sharded), int(so.step_count), so.state.numel, so.client,
            so.state, so.chunks, so.extra_state(),
        )  # fmt: skip

    def load(self) -> GroupLoad:
        return GroupLoad(self.optimizer)

    def master_from_params(self) -> None:
        """The master takes the 16-bit params' values (a load of the weights alone)."""
        self.optimizer.master_from_params()

    def write_master(self, lo: int, src: torch.Tensor) -> None:
        """Master elements [lo, lo + src.numel()) take ``src`` (an edit of the params)."""
        self.state.write("master", lo, src)

    def fragment(self, what: str, key: str = "", fn: str = "") -> list:
        """This rank's pieces of ``what`` ("fp32": the master, "grad": the reduced gradient,
        "state": optimizer-state ``key``), one per segment (segment k: the rank's slice of
        bucket k); each a tensor or, where the values are not in memory as one tensor, a
        ``StateRange``. ``fn`` names the caller in errors."""
        if what == "grad":
            t = grad_source(self.grads, self.placement.host_update)
            if isinstance(t, list):
                return t
        elif what == "fp32":
            t = state_source(self.state, "master")
        else:
            t = state_tensor(self.optimizer, key, fn)
        segs = self.flat.segments(self.optimizer.sharded)
        return [t[s.shard_start : s.shard_start + s.numel] for s in segs]

    def refresh_grad_norm(self, device: torch.device) -> None:
        """The squared gradient norm (this rank's part) from the reduced gradient as it is now
        (after the fragment API wrote it)."""
        views = self.fragment("grad")
        views = [v.read() if isinstance(v, StateRange) else v for v in views]
        sumsq = sum(
            (sum_of_squares(v).to(device) for v in views),
            torch.zeros((), dtype=torch.float32, device=device),
        )
        self.grads.set_sumsq(sumsq)

    # ---- the step protocol ---------------------------------------------------------------------
    @property
    def stage_writes(self) -> bool:
        """``stage`` writes the update and may fail part way: the ranks agree before a commit."""
        return self.optimizer.stage_writes

    def prepare(self) -> None:
        """The backward that ends a window began: start what the update can do already."""
        self.optimizer.prepare_update()

    def stage(self, factor: float, step: int) -> None:
        """Stage global step ``step``'s update with the combined grad factor (unscale x clip);
        from ``placement.delayed_after`` on, the update is the delayed one."""
        after = self.placement.delayed_after
        self.optimizer.stage(factor, delayed=after is not None and step >= after)

    def commit(self) -> None:
        self.optimizer.commit()

    def rollback(self) -> None:
        """Master, moments, step count and params back to the last committed step."""
        self.optimizer.rollback()

    def skip(self) -> None:
        """A step with no update (overflow): a pending delayed update still lands."""
        self.optimizer.flush()

    def flush(self) -> None:
        """Apply a pending delayed update now (before eval, saving, editing params)."""
        self.optimizer.flush()

    def close(self) -> None:
        """Release what the group holds beyond memory (``engine.destroy``)."""
        self.optimizer.close()


def build_shard_optimizer(
    group: FlatGroup,
    grads: GradShard,
    home: ParamHome,
    state: ShardState,
    policy: UpdatePolicy,
    streams: Streams,
    executor: HostWorker | None = None,
    client: torch.optim.Optimizer | None = None,
) -> ShardOptimizer:
    """The update of one group, its parts chosen once: the rule (Muon for a Muon group, a
    client optimizer, else Adam(W)), the placement's update over the state kind, and the
    runner (``executor``: the delayed update's worker, host placement only)."""
    args = (group, grads, home, state, policy, streams)
    place = policy.placement
    if group.hyper.get("use_muon"):  # the config refuses Muon on NVMe, delayed or twin
        assert client is None and place.optimizer != "nvme" and not place.twin
        rule: Rule = MuonRule()
    else:
        rule = ClientRule() if client is not None else AdamRule()
    if place.optimizer == "device":
        return DeviceUpdate(*args, client=client, rule=rule)
    if place.twin:
        return TwinUpdate(*args)
    worker = executor if place.delayed and not group.hyper.get("use_muon") else None
    runner = choose_runner(state.transactional, worker)
    return HostUpdate(*args, client=client, rule=rule, runner=runner, delayed=worker is not None)
