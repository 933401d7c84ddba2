"""One backward through the engine's model: a prologue when it starts and an epilogue when the
outermost autograd graph task that runs it ends.

Why the outermost task: reentrant activation checkpointing (``use_reentrant=True``) runs each
recomputed block's backward as a nested graph task. A callback queued from a hook that fires
inside one runs when *that* task ends, after one block, while the other blocks' gradients do not
exist yet; ending the backward there reduced the remaining buckets as zeros and reset the counts.

Invariant: the end callback is queued on the task the caller started, from a hook that runs in
it before any param's gradient: a pre-hook on the loss's ``grad_fn`` (``engine.backward``) or a
hook on the gradient of the engine's forward outputs (a plain ``loss.backward()``). Only a
backward that enters the model by neither route (through ``engine.module`` directly) falls back
to the task of the first gradient hook that fires.

Under a ``torch.func`` transform (``grad``, ``grad_and_value``, ``jacrev``, ``vmap(grad)``) the
engine at stages 0-2 is an ordinary function being differentiated: neither route opens a
backward, so nothing is scaled, reduced or written into gradient shards (the transform returns
the gradients it asked for, as plain PyTorch's would). Stage 3 gathers its params with hooks a
transform cannot run through: not supported there (as in DeepSpeed's own tests).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._pytree import tree_flatten

ENGINE = "engine.backward"
PLAIN = "loss.backward"


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def functorch_transforming() -> bool:
    """True inside a ``torch.func`` transform (its interpreter stack is not empty)."""
    functorch = getattr(torch._C, "_functorch", None)
    peek = getattr(functorch, "peek_interpreter_stack", None)
    return peek is not None and peek() is not None


class BackwardScope:
    """``begin(driver)`` runs the prologue once per backward (it may raise; nothing changes
    then); ``end`` runs every epilogue, in registration order, once per backward."""

    def __init__(self, prologue: Callable[[str], None]) -> None:
        self._prologue = prologue
        self._epilogues: list[Callable[[], None]] = []
        self._abandons: list[Callable[[], None]] = []
        self.open = False
        self._queued = False

    def on_end(self, fn: Callable[[], None], abandon: Callable[[], None]) -> None:
        """``fn`` at the end of each backward; ``abandon`` instead when a backward never ended
        (it raised part way): local state is reset, no collective is issued."""
        self._epilogues.append(fn)
        self._abandons.append(abandon)

    def begin(self, driver: str) -> None:
        if self.open:
            if in_backward():
                return  # the same backward: a second route into it
            self.abandon()  # outside autograd with the scope open: the last backward raised
        self._prologue(driver)
        self.open, self._queued = True, False

    def queue(self) -> None:
        """Called from inside autograd: the end runs when the current graph task finishes."""
        if self.open and not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.end)
            self._queued = True

    def ensure(self) -> None:
        """A gradient hook fired: the backward has begun, by whatever route."""
        if not self.open:
            self.begin(PLAIN)
        self.queue()

    def end(self) -> None:
        if not self.open:
            return
        self.open = self._queued = False
        self._run(self._epilogues)

    def abandon(self) -> None:
        if not self.open:
            return
        self.open = self._queued = False
        self._run(self._abandons)

    @staticmethod
    def _run(fns: list[Callable[[], None]]) -> None:
        first: BaseException | None = None
        for fn in fns:
            try:
                fn()
            except BaseException as e:  # every component resets; the first error is raised
                first = first or e
        if first is not None:
            raise first

    # ---- the routes into a backward ------------------------------------------------------------
    def attach_loss(self, loss: torch.Tensor) -> None:
        if loss.grad_fn is not None and not functorch_transforming():
            loss.grad_fn.register_prehook(lambda _grads: self.queue())

    def attach_outputs(self, outputs: object) -> None:
        """Hooks on the forward's outputs that open a plain ``loss.backward()``."""
        if not torch.is_grad_enabled() or functorch_transforming():
            return
        for t in tree_flatten(outputs)[0]:
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                t.register_hook(self._output_grad)

    def _output_grad(self, grad: torch.Tensor) -> None:
        self.begin(PLAIN)
        self.queue()
