"""Stage 3: when params are fetched, prefetched and released (the param store does the moving).

Module hooks, installed on every submodule of the model, so any forward gathers what it needs
(through the engine or not: ``engine.module.generate``, ``torch.no_grad()`` evaluation):

- forward pre-hook: fetch the module's slots (the units of the params it owns directly, plus any
  other module's params it was seen reading, see below), then prefetch ahead;
- forward post-hook: release the module's slots, except those a module still running (an
  ancestor on the forward stack) needs. Inside backward (activation-checkpoint recomputation)
  nothing is released here: the backward about to run needs the params. When the output
  requires grad, a hook on it fetches the module's slots again before its backward runs;
- after a param's gradient is final (post-accumulate-grad hook), its slot is released once every
  trainable param in it is final; a slot without trainable params (frozen weights, LoRA's base)
  is released when backward reaches the module's inputs (an identity autograd function on them);
  at the end of backward everything not persistent is released.

Params read across modules (a head that uses ``embedding.weight`` in its parent's forward): each
module's ``_parameters`` dict is replaced by one whose ``__getitem__`` notices a read of a
partitioned param while a forward runs, fetches it if needed and records it as needed by the
module whose forward is running, so it is fetched with that module from then on.

Reuse: a slot the recorded order demands again within ``stage3_max_reuse_distance`` elements is
not released after its forward (while live stays under ``stage3_max_live_parameters``).

Prefetch: the order in which slots were demanded in the previous pass of the same kind (train or
eval, grad or not) is replayed; on each demand that matches the recorded order the next slots are
gathered asynchronously, up to ``stage3_prefetch_bucket_size`` elements ahead and never beyond
``stage3_max_live_parameters`` live. A demand that departs from the recorded order stops
prefetching for the rest of the pass; the new order is used on the next one. All ranks record the
same order, so they issue the same collectives. Where ranks could diverge (a pass with no
recorded order, a departure from it) every demand is first agreed on by all ranks through the
rendezvous store (``gather_agreement.py``): different modules on different ranks are an error
naming the params, never a mismatched collective.
"""

from __future__ import annotations

import copy
import weakref

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ...core import dist, partitioned
from ...core.consistency import RankMismatchError
from ...core.status import ZeroParamStatus
from ..backward_scope import BackwardScope, in_backward
from .gather_agreement import GatherAgreement
from .param_store import ParamStore, Stage3Policy
from .partition_units import scheduled_modules


class _AfterBackward(torch.autograd.Function):
    """Identity on a module's inputs whose backward runs ``fn`` once every op of the module that
    consumed them has run its backward."""

    @staticmethod
    def forward(ctx, fn, *tensors):
        ctx.fn = fn
        return tensors  # as-is (not views): the module may modify them in place

    @staticmethod
    def backward(ctx, *grads):
        ctx.fn()
        return (None, *grads)


def _after_backward(args_kwargs: tuple, fn):
    """(args, kwargs) with the float tensors that require grad routed through _AfterBackward, or
    None when no input requires grad (the end of backward releases then)."""
    flat, spec = tree_flatten(args_kwargs)
    idx = [k for k, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not idx:
        return None
    outs = _AfterBackward.apply(fn, *[flat[k] for k in idx])
    for k, t in zip(idx, outs):
        flat[k] = t
    return tree_unflatten(flat, spec)


def _returned_slots(flat: list, owned: set[int]) -> list[int]:
    """Slots of the partitioned params among a forward's outputs (also one attribute deep in an
    output object), of those the module fetched."""
    found = []
    for x in flat:
        items = [x] if isinstance(x, torch.Tensor) else list(getattr(x, "__dict__", {}).values())
        for t in items:
            i = partitioned.slot_of(t) if isinstance(t, torch.nn.Parameter) else None
            if i is not None and i in owned and i not in found:
                found.append(i)
    return found


class _ParamDict(dict):
    """A module's ``_parameters`` that reports reads of partitioned params to the schedule."""

    def __init__(self, src: dict, schedule: FetchSchedule) -> None:
        super().__init__(src)
        self._schedule = weakref.ref(schedule)

    def __getitem__(self, name):
        p = dict.__getitem__(self, name)
        i = partitioned.slot_of(p)
        if i is not None:
            sched = self._schedule()
            if sched is not None and sched.stack:
                sched.on_read(i)
        return p

    def __deepcopy__(self, memo):  # a copy of the module is not scheduled: a plain dict
        return copy.deepcopy(dict(self.items()), memo)

    def __reduce__(self):
        return (dict, (dict(self.items()),))


class FetchSchedule:
    def __init__(
        self,
        store: ParamStore,
        module: torch.nn.Module,
        policy: Stage3Policy,
        scope: BackwardScope,
    ) -> None:
        self.store, self.module, self.policy, self.scope = store, module, policy, scope
        self.stack: list[torch.nn.Module] = []
        self.needs: dict[int, list[int]] = {}  # id(module) -> slot ids it fetches
        self.need_sets: dict[int, set[int]] = {}
        self.module_handles: list = []  # forward pre/post hooks of every scheduled module
        self.grad_handles: list = []  # post-accumulate-grad hooks of the trainable params
        self.modules = []
        store.schedule = self
        for m, owned in scheduled_modules(module):  # a leaf module: its whole subtree
            ids = []
            for p in [*owned, *partitioned.external_params(m)]:
                i = partitioned.slot_of(p)
                if i is not None and i not in ids:
                    ids.append(i)
            self.needs[id(m)] = ids
            self.need_sets[id(m)] = set(ids)
            self.modules.append(m)
            m.__dict__["_parameters"] = _ParamDict(m._parameters, self)
        self.grad_pending = [0] * len(store.slots)
        self.grad_count = [sum(p.requires_grad for p in s.params) for s in store.slots]
        self.install_hooks()
        self._reset_grads()
        self.traces: dict[tuple, list[int]] = {}
        self.recording: list[int] | None = None
        self.rec_key: tuple | None = None
        self.replay: list[int] | None = None
        self.pos = 0
        self.suspended = False  # unwrap_model_for_generation: every param held gathered
        self.parameter_offload = None  # DeepSpeed's adapter (zero.parameter_offload), once asked
        self.order_checked = False
        self.passes = 0  # passes begun: the same count on every rank while they agree
        self.blocks = 0  # GatheredParameters blocks entered
        self.agreement = GatherAgreement.create(self.describe)
        scope.on_end(self._end_backward, self._end_backward)

    def describe(self, value: str) -> str:
        """The params of the slots ``value`` lists (an agreement point's value)."""
        return "; ".join(self.store.slots[int(i)].label for i in value.split(","))

    def agree_block(self, ids: list[int]) -> None:
        """A ``GatheredParameters`` block: every rank enters it with the same params."""
        if self.agreement is not None:
            self.blocks += 1
            where = f"GatheredParameters block {self.blocks}"
            self.agreement.agree(f"block{self.blocks}", ",".join(map(str, ids)), where)

    # ---- hooks ---------------------------------------------------------------------------------
    def install_hooks(self) -> None:
        """(Re)register the module hooks and the gradient hooks, removing any present first (no
        hook is ever registered twice). The gradient hooks come after the reducer's, as at
        construction. TRL's generation unwrap removes both sets and puts them back through this
        (``zero.parameter_offload``)."""
        self.remove_hooks()
        for m in self.modules:
            pre = m.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
            post = m.register_forward_hook(self._post_forward, always_call=True)
            self.module_handles += [pre, post]
        for s in self.store.slots:
            for p in s.params:
                if p.requires_grad:
                    self.grad_handles.append(p.register_post_accumulate_grad_hook(self._grad_final))

    def remove_hooks(self) -> None:
        for h in [*self.module_handles, *self.grad_handles]:
            h.remove()  # removing a removed handle is a no-op
        self.module_handles, self.grad_handles = [], []

    def invalidate_trace(self) -> None:
        """Forget every recorded fetch order: each kind of pass records its order afresh on its
        next run (without prefetch until then)."""
        self.traces.clear()
        self.recording = self.rec_key = self.replay = None
        self.pos = 0

    # ---- pass bookkeeping ----------------------------------------------------------------------
    def _begin_pass(self) -> None:
        if self.recording is not None and self.rec_key is not None:
            self.traces[self.rec_key] = self.recording
        self.rec_key = (self.module.training, torch.is_grad_enabled())
        self.recording = []
        self.replay = self.traces.get(self.rec_key)
        self.pos = 0
        self.passes += 1

    def _demand(self, ids: list[int]) -> None:
        rec, replay = self.recording, self.replay
        for i in ids:
            new = rec is not None and (not rec or rec[-1] != i)
            if new:
                rec.append(i)
            recorded = None  # what the recorded order has here, when this demand departs from it
            if replay is not None:
                if self.pos < len(replay) and replay[self.pos] == i:
                    self.pos += 1
                elif not (self.pos > 0 and replay[self.pos - 1] == i):
                    recorded = replay[self.pos] if self.pos < len(replay) else None
                    self.replay = replay = None  # the order changed: stop guessing this pass
            if new and replay is None and self.agreement is not None:
                self._agree(len(rec), i, recorded)
        self.store.fetch(ids)
        if replay is not None:
            self._prefetch(replay)

    def _agree(self, k: int, i: int, recorded: int | None) -> None:
        """Gather ``k`` of this pass (slot ``i``) where ranks could diverge: all ranks agree."""
        where = f"pass {self.passes}, gather {k}"
        if recorded is not None:
            where += f" (earlier passes had the {self.store.slots[recorded].label} there)"
        self.agreement.agree(f"pass{self.passes}/{k}", str(i), where)

    def _prefetch(self, replay: list[int]) -> None:
        store, ahead, j = self.store, 0, self.pos
        limit = self.policy.max_live_parameters
        while j < len(replay) and ahead < self.policy.prefetch_bucket_size:
            slot = store.slots[replay[j]]
            if slot.status is ZeroParamStatus.NOT_AVAILABLE:
                if store.live + slot.numel > limit:
                    break
                store.start(slot.index)
            ahead += slot.numel
            j += 1
        if store.read_depth:  # NVMe: start reading the own slices of the slots after those
            store.read_ahead(replay[j : j + store.read_depth])

    def add_external(self, m: torch.nn.Module, i: int) -> None:
        if id(m) in self.need_sets and i not in self.need_sets[id(m)]:
            self.need_sets[id(m)].add(i)
            self.needs[id(m)].append(i)

    def on_read(self, i: int) -> None:
        """A param of slot ``i`` was read while the top module's forward runs."""
        self.add_external(self.stack[-1], i)
        if self.store.slots[i].status is not ZeroParamStatus.AVAILABLE:
            self._demand([i])

    # ---- forward -------------------------------------------------------------------------------
    def _pre_forward(self, m: torch.nn.Module, args, kwargs):
        if self.suspended:
            return None
        backward = in_backward()
        if not self.stack and not backward:
            self._begin_pass()
        self.stack.append(m)
        ids = self.needs[id(m)]
        if not ids:
            return None
        self._demand(ids)
        frozen = [i for i in ids if not self.grad_count[i]]
        if frozen and torch.is_grad_enabled() and not backward:
            # Frozen params get no gradient to say they are done: release them when the backward
            # reaches this module's inputs, i.e. after the module's own backward ran.
            return _after_backward((args, kwargs), lambda: self._frozen_done(frozen))
        return None

    def _frozen_done(self, ids: list[int]) -> None:
        if not self.stack:
            for i in ids:
                self.store.release(i)

    def _post_forward(self, m: torch.nn.Module, args, output) -> None:
        if self.suspended:
            return
        if self.stack and self.stack[-1] is m:
            self.stack.pop()
        ids = self.needs[id(m)]
        if not ids:
            return
        flat = tree_flatten(output)[0]
        if self.stack:  # a param it returns is used by the caller: fetched with it from now on
            for i in _returned_slots(flat, self.need_sets[id(m)]):
                self.add_external(self.stack[-1], i)
        backward = in_backward()
        if torch.is_grad_enabled() and not backward:
            tensors = [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, lambda _g, ids=ids: self._pre_backward(ids), mode="any"
                )
        if backward:
            return
        still = set()
        for a in self.stack:
            still |= self.need_sets[id(a)]
        for i in ids:
            if i not in still and not self._reused_soon(i):
                self.store.release(i)

    def _reused_soon(self, i: int) -> bool:
        """``stage3_max_reuse_distance``: keep a slot that the recorded order demands again within
        that many gathered elements, while the live bound allows."""
        replay, budget = self.replay, self.policy.max_reuse_distance
        if replay is None or budget <= 0 or self.store.live > self.policy.max_live_parameters:
            return False
        distance = 0
        for j in replay[self.pos :]:
            if j == i:
                return True
            distance += self.store.slots[j].numel
            if distance > budget:
                return False
        return False

    # ---- backward ------------------------------------------------------------------------------
    def _pre_backward(self, ids: list[int]) -> None:
        self.scope.ensure()
        self._demand(ids)

    def _grad_final(self, p: torch.Tensor) -> None:
        i = partitioned.slot_of(p)
        self.grad_pending[i] -= 1
        if self.grad_pending[i] == 0 and not self.stack:
            self.store.release(i)

    def _end_backward(self) -> None:
        self._reset_grads()
        if not self.order_checked and self.module.training:
            self.order_checked = True
            self._check_same_order()
        if not self.stack:
            self.store.release_all()

    def _check_same_order(self) -> None:
        """Once, at the end of the first training backward: every rank gathered the same slots in the same order. Ranks that ran different modules (data-dependent calls, as in
        Mixture-of-Experts routing) pair different params in one all-gather, silently when the
        sizes agree: refuse before the first update, naming the first difference."""
        if self.store.world == 1 or self.recording is None:
            return
        orders: list = [None] * self.store.world
        dist.all_gather_object(orders, list(self.recording))
        ref = orders[0]
        for r, order in enumerate(orders[1:], start=1):
            if order == ref:
                continue
            k = next(
                (i for i, (a, b) in enumerate(zip(ref, order)) if a != b), min(len(ref), len(order))
            )
            mine, theirs = (
                self.store.slots[o[k]].label if k < len(o) else "nothing" for o in (ref, order)
            )
            raise RankMismatchError(
                f"ranks gathered stage-3 params in different orders in the first step: at "
                f"gather {k} rank 0 did the {mine}, rank {r} the {theirs}. Modules "
                "called depending on the data (Mixture-of-Experts experts) must be fetched "
                "whole: mark their block with zero_offload.utils.set_z3_leaf_modules or the "
                "zero_optimization.leaf_module config"
            )

    def _reset_grads(self) -> None:
        self.grad_pending[:] = self.grad_count

    # ---- teardown ------------------------------------------------------------------------------
    def remove(self) -> None:
        if self.agreement is not None:
            self.agreement.close()
        self.remove_hooks()
        for m in self.modules:
            m.__dict__["_parameters"] = dict(m._parameters.items())
