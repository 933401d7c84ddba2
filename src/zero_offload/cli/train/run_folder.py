"""The main job's run folder: metrics.csv, loss.png and JSON files, written by rank 0 only."""

from __future__ import annotations

import math
import os
import time
from typing import Any

METRIC_COLUMNS = ("step", "loss", "lr", "tokens_per_s", "grad_norm", "loss_scale", "mem_mib")


class RunFolder:
    """The run's files. Every rank holds one, but only rank 0's writes anything."""

    def __init__(self, path: str | None, writer: bool, resume_at: int | None = None) -> None:
        """``resume_at``: the first step of a resumed run. An existing metrics.csv is then
        continued: its rows before that step are kept (later ones were trained again), the new
        rows are appended, and the plot shows them all."""
        self.path = path
        self.writer = writer
        self._written: list[str] = []
        self._rows: list[dict[str, Any]] = []
        self._csv = None
        if writer:
            assert path is not None
            os.makedirs(path, exist_ok=True)
            csv_path = os.path.join(path, "metrics.csv")
            if resume_at is not None and os.path.isfile(csv_path):
                self._rows = [r for r in _read_rows(csv_path) if r["step"] < resume_at]
            tmp = csv_path + ".tmp"
            with open(tmp, "w", newline="") as handle:  # kept rows, replaced in one rename
                handle.write(",".join(METRIC_COLUMNS) + "\n")
                for row in self._rows:
                    handle.write(",".join(_csv_value(row[c]) for c in METRIC_COLUMNS) + "\n")
            os.replace(tmp, csv_path)
            self._csv = open(csv_path, "a", newline="")
            self._written.append("metrics.csv")

    @classmethod
    def create(cls, out: str | None, rank: int, resume_at: int | None = None) -> RunFolder:
        path = out or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
        return cls(path, writer=rank == 0, resume_at=resume_at)

    def add_metrics(self, row: dict[str, Any]) -> None:
        if self._csv is None:
            return
        self._rows.append(row)
        self._csv.write(",".join(_csv_value(row[c]) for c in METRIC_COLUMNS) + "\n")
        self._csv.flush()  # a run stopped early still leaves its curve behind

    def write_json(self, name: str, data: dict[str, Any]) -> None:
        if not self.writer:
            return
        import json

        assert self.path is not None
        with open(os.path.join(self.path, name), "w") as handle:
            json.dump(data, handle, indent=2)
            handle.write("\n")
        self._written.append(name)

    def plot_loss(self, heldout: float) -> None:
        if not self.writer or not self._rows:
            return
        import matplotlib

        matplotlib.use("Agg")  # files only: no display on training machines
        import matplotlib.pyplot as plt

        assert self.path is not None
        steps = [r["step"] for r in self._rows]
        fig, (ax_loss, ax_lr) = plt.subplots(
            2, 1, figsize=(7, 5), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
        )
        losses = [r["loss"] for r in self._rows]
        ax_loss.plot(steps, losses, lw=0.8, alpha=0.4, color="C0", label="train loss")
        window = max(1, len(losses) // 30)
        smooth = [
            sum(losses[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1))
            for i in range(len(losses))
        ]
        ax_loss.plot(steps, smooth, lw=1.5, color="C0", label=f"mean of {window} steps")
        if math.isfinite(heldout):
            ax_loss.axhline(heldout, color="C1", ls="--", label=f"held-out {heldout:.3f}")
        ax_loss.set_ylabel("loss (nats/byte)")
        ax_loss.grid(alpha=0.3)
        ax_loss.legend()
        ax_lr.plot(steps, [r["lr"] for r in self._rows], color="C2", lw=1)
        ax_lr.set_ylabel("lr")
        ax_lr.set_xlabel("step")
        ax_lr.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(os.path.join(self.path, "loss.png"), dpi=100)
        plt.close(fig)
        self._written.append("loss.png")

    def files(self) -> list[str]:
        return list(self._written)

    def close(self) -> None:
        if self._csv is not None:
            self._csv.close()
            self._csv = None


def _read_rows(csv_path: str) -> list[dict[str, Any]]:
    """The rows of an earlier metrics.csv (numbers parsed; a malformed row ends the read)."""
    import csv

    rows = []
    with open(csv_path, newline="") as handle:
        for raw in csv.DictReader(handle):
            try:
                row: dict[str, Any] = {
                    c: (float(raw[c]) if raw.get(c) not in (None, "") else None)
                    for c in METRIC_COLUMNS
                }
                row["step"] = int(raw["step"])
            except (KeyError, TypeError, ValueError):
                break
            rows.append(row)
    return rows


def _csv_value(value: Any) -> str:
    if value is None:
        return ""
    return f"{value:.6g}" if isinstance(value, float) else str(value)
