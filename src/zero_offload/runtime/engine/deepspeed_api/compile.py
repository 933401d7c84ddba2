"""DeepSpeed's ``engine.compile()`` and ``engine.is_compiled``, as a mixin of the engine.

As DeepSpeed does, ``compile`` compiles the wrapped module in place (``nn.Module.compile``), so
``engine.module`` stays the user's module and the engine's forward calls the compiled one. At
stages 0-2 the engine's work happens outside the traced forward: gradients leave through
hooks on each param's gradient accumulation, which autograd runs eagerly, and the params are
views of the flat buffer that the update writes in place, so a compiled step equals an
uncompiled one. Stage 3 gathers and releases params in forward hooks on every submodule,
which the traced forward cannot follow yet: refused by name. DeepCompile (``schedule``) and
compiled autograd are not built: refused by name too.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ...errors import EngineUsageError

log = logging.getLogger("zero_offload")

# DeepSpeed's default: get_accelerator().get_compile_backend() is "inductor" on CUDA and CPU.
DEFAULT_BACKEND = "inductor"


class CompileNotSupportedError(EngineUsageError):
    """``engine.compile()`` asked for what this engine cannot compile (yet)."""


def _refusal(stage: int, schedule: Any, compiled_autograd_enabled: bool) -> str | None:
    """Why this compile request is refused, or None."""
    if stage == 3:
        return (
            "engine.compile(): ZeRO stage 3 cannot be compiled yet: its forward hooks gather and "
            "release each submodule's partitioned params, which torch.compile's traced forward "
            "does not follow (the losses would differ from the uncompiled run). Train stage 3 "
            "uncompiled, or compile at stage 0, 1 or 2"
        )
    if schedule is not None:
        return (
            "engine.compile(schedule=...): DeepCompile schedules are not built here; call "
            "compile() without schedule (plain torch.compile of the module)"
        )
    if compiled_autograd_enabled:
        return (
            "engine.compile(compiled_autograd_enabled=True): compiled autograd is not built here "
            "(the gradient hooks reduce eagerly); call compile() without it"
        )
    return None


class CompileAPI:
    """Mixed into ZeroOffloadEngine; uses its ``module`` and ``stage``."""

    _is_compiled: bool = False
    _compile_kwargs: dict[str, Any] | None = None

    def compile(
        self,
        backend: Any = DEFAULT_BACKEND,
        compile_kwargs: dict[str, Any] | None = None,
        schedule: Any = None,
        compiled_autograd_enabled: bool = False,
    ) -> None:
        """Compile the wrapped module in place with ``torch.compile`` (DeepSpeed's signature:
        ``compile_kwargs`` are ``torch.compile``'s keywords, ``backend`` wins over one given
        there). A second call does nothing, as in DeepSpeed. Raises
        :class:`CompileNotSupportedError` at stage 3, with a DeepCompile ``schedule`` or with
        ``compiled_autograd_enabled``."""
        kwargs = dict(compile_kwargs or {})
        if not isinstance(backend, str) and not callable(backend):
            raise ValueError(
                f"engine.compile(): backend must be a torch.compile backend name or callable, "
                f"got {backend!r}"
            )
        why = _refusal(self.stage, schedule, compiled_autograd_enabled)
        if why is not None:
            raise CompileNotSupportedError(why)
        if self._is_compiled:
            return
        if "backend" in kwargs:
            log.warning(
                "engine.compile(): the `backend` in `compile_kwargs` is overridden; use the "
                "`backend` argument instead"
            )
        module: torch.nn.Module = self.module
        module.compile(**{**kwargs, "backend": backend})
        self._is_compiled = True
        self._compile_kwargs = kwargs

    @property
    def is_compiled(self) -> bool:
        """Whether :meth:`compile` compiled the module."""
        return self._is_compiled
