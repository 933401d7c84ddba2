"""Bytes the checkpoints hold, by where they wait: ``device`` (an input kept on the device for
its recompute, or brought back from the host for it) and ``host`` (``cpu_checkpointing``'s
copies). Current and peak per place, for the engine's ``memory_report()``."""

from __future__ import annotations


class CheckpointBytes:
    """Counters one process shares (the checkpointing API is process-wide, as DeepSpeed's)."""

    PLACES = ("device", "host")

    def __init__(self) -> None:
        self.held = dict.fromkeys(self.PLACES, 0)
        self.peak = dict.fromkeys(self.PLACES, 0)
        self.used = False

    def add(self, place: str, nbytes: int) -> None:
        self.used = True
        self.held[place] += nbytes
        self.peak[place] = max(self.peak[place], self.held[place])

    def remove(self, place: str, nbytes: int) -> None:
        self.held[place] -= nbytes

    def reset_peak(self) -> None:
        self.peak = dict(self.held)

    def report(self) -> dict[str, int]:
        """``peak.<place>.activation_checkpoints``, empty while no checkpoint ever kept
        anything. Only peaks: the kept inputs are a step's transient (none are held between
        steps), never a state."""
        if not self.used:
            return {}
        return {f"peak.{place}.activation_checkpoints": self.peak[place] for place in self.PLACES}


COUNTERS = CheckpointBytes()
