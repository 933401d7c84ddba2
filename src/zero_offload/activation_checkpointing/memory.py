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
        """``host.activation_checkpoints`` (held now) and ``peak.<place>.activation_
        checkpoints``; empty while no checkpoint ever kept anything."""
        if not self.used:
            return {}
        out = {"host.activation_checkpoints": self.held["host"]}
        for place in self.PLACES:
            out[f"peak.{place}.activation_checkpoints"] = self.peak[place]
        return out


COUNTERS = CheckpointBytes()
