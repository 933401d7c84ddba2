"""Smoke test of the step benchmark: the quick run finishes, prints the table, and every row trained
the same model to the same loss (a row that measured something else would not)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "engine_step.py"


def test_quick_table(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--quick",
            "--world",
            "1",
            "--no-deepspeed",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=170,  # about 45 s on 2 idle cores: seven runs of ~6 s process start-up each
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    header = next(ln for ln in lines if ln.startswith("| impl |"))
    for col in ("s/step", "tokens/s", "x torch", "x DS", "peak RSS MiB", "acct dev/host MiB"):
        assert col in header
    rows = [ln for ln in lines if ln.startswith(("| torch |", "| engine |"))]
    assert len(rows) == 7, "\n".join(lines)  # plain PyTorch + six engine modes
    assert not any("error" in ln for ln in rows), "\n".join(rows)

    data = json.loads(out.read_text())
    by_mode = {(r["impl"], r["stage"], r["offload"]): r for r in data["rows"]}
    ref = by_mode[("torch", 0, "-")]["losses"]
    for key, r in by_mode.items():
        assert r["median_s"] > 0 and r["peak_rss_mib"] > 0, key
        assert all(math.isfinite(x) for x in r["losses"]), key
        if key[0] == "engine":
            # The engine's accounting is next to its formula, and model state is accounted.
            assert r["accounted_mib"][0] + r["accounted_mib"][1] > 0, key
            assert r["expected_mib"] is not None, key
        # fp32, same weights, data and recipe: the same losses up to summation order. The
        # delayed update's second forward still runs on the initial params: compare its first.
        n = 1 if key[2] == "cpu+delayed" else len(ref)
        for a, b in zip(r["losses"][:n], ref[:n]):
            assert abs(a - b) <= 1e-4 * abs(b), (key, r["losses"], ref)
