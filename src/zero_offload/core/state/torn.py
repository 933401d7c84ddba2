"""The error of a state that is not one committed step (below the runtime and the checkpoint
code, which both name it)."""

from __future__ import annotations


class TornStateError(RuntimeError):
    """The optimizer state is not one committed step: an update failed after part of it was
    applied. Loading a checkpoint (``engine.load_checkpoint``) restores a whole step."""

    def __init__(self, reason: str) -> None:
        super().__init__(
            f"the optimizer state is only partly updated ({reason}); no step or save runs "
            "on it: load the last checkpoint (engine.load_checkpoint) to go on"
        )
        self.reason = reason
