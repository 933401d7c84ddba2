"""The errors of driving an engine wrongly, below every runtime folder: the engine's guards,
the offload of its states and its compile wrapper raise them."""

from __future__ import annotations


class EngineUsageError(RuntimeError):
    """The engine's API was called in an order or with a value it cannot act on."""


class EngineAssertionError(EngineUsageError, AssertionError):
    """A use DeepSpeed refuses with an ``assert`` (``no_sync`` at stage 2/3, unused params with
    ``ignore_unused_parameters`` false): code that catches ``AssertionError`` for it catches
    this too."""


def check_alive(destroyed: bool, what: str) -> None:
    if destroyed:
        raise EngineUsageError(
            f"engine.{what}() after engine.destroy(): this engine no longer holds the model "
            "(its hooks are gone and its state released); initialize() a new engine"
        )
