"""Smoke test of the step benchmark: the quick run finishes, prints the table, and every row trained
the same model to the same loss (a row that measured something else would not)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "engine_step.py"


# (extra flags, implementations in the table, rows): stages 0-2 with the engine's six modes, and
# stage 3 with the engine's three modes and FSDP2's two, each with the plain PyTorch anchor.
CASES = {
    "stages012": (
        ["--stages", "0", "1", "2", "--impls", "torch", "engine"],
        ("torch", "engine"),
        7,
    ),
    "stage3": (
        ["--stages", "3", "--impls", "torch", "engine", "fsdp2"],
        ("torch", "engine", "fsdp2"),
        6,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_quick_table(tmp_path: Path, case: str) -> None:
    flags, impls, n_rows = CASES[case]
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
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=170,  # about 45 s on 2 idle cores: seven runs of ~6 s process start-up each
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    header = next(ln for ln in lines if ln.startswith("| impl |"))
    for col in (
        "s/step",
        "tokens/s",
        "x torch",
        "x DS",
        "x FSDP2",
        "peak RSS MiB",
        "acct dev/host MiB",
    ):
        assert col in header
    rows = [ln for ln in lines if ln.startswith(tuple(f"| {i} |" for i in impls))]
    assert len(rows) == n_rows, "\n".join(lines)
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
