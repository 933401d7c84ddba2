"""The GPU suite's plumbing, on the CPU: the model-size search, the throughput options
(accumulation, activation checkpointing, zero.Init, mode filter) and the one-call suite with its
report and target checks. The GPU numbers themselves come from the GPU machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from gpu_suite import link_use, targets  # noqa: E402
from model_size import Attempt, climb  # noqa: E402


def _fake(limit: int):
    """Attempts that train up to rung ``limit`` and fail above it."""
    calls: list[int] = []

    def attempt(i: int) -> Attempt:
        calls.append(i)
        return Attempt(
            i, result={"median_s": 1.0} if i <= limit else {"error": "CUDA out of memory"}
        )

    return attempt, calls


@pytest.mark.parametrize(
    "start,limit,calls",
    [
        (3, 5, [3, 4, 5, 6]),  # climbs until the first failure
        (3, 1, [3, 2, 1]),  # descends until the first success
        (3, 3, [3, 4]),  # the formula was right
        (0, -1, [0]),  # nothing trains, nothing below
        (7, 9, [7]),  # the ladder's top trained
    ],
)
def test_climb_finds_the_largest_rung(start: int, limit: int, calls: list[int]) -> None:
    attempt, seen = _fake(limit)
    tried = climb(8, start, attempt, max_runs=10)
    assert seen == calls
    ok = [a.rung for a in tried if a.ok]
    assert max(ok, default=-1) == min(limit, 7)


def test_climb_stops_at_max_runs() -> None:
    attempt, seen = _fake(7)
    climb(8, 0, attempt, max_runs=3)
    assert seen == [0, 1, 2]


def test_targets_compare_with_deepspeed_and_no_offload() -> None:
    rows = [
        {"impl": "engine", "stage": 0, "offload": "-", "median_s": 1.0},
        {"impl": "engine", "stage": 2, "offload": "cpu", "median_s": 1.3, "vs_deepspeed": 0.8},
        {
            "impl": "engine",
            "stage": 2,
            "offload": "cpu+delayed",
            "median_s": 1.05,
            "vs_deepspeed": 0.65,
        },  # fmt: skip
        {
            "impl": "engine",
            "stage": 3,
            "offload": "cpu+param",
            "median_s": 2.0,
            "vs_deepspeed": 1.2,
        },  # fmt: skip
        {"impl": "deepspeed", "stage": 2, "offload": "cpu", "error": "boom"},
    ]
    lines = targets({"rows": rows})
    assert any("stage 2 cpu: 0.80x" in ln and "meets" in ln for ln in lines)
    assert any("stage 3 cpu+param: 1.20x" in ln and "MISSES" in ln for ln in lines)
    assert any("delayed update: 1.05x" in ln and "meets" in ln for ln in lines)


def test_link_use_against_the_pinned_peak() -> None:
    pcie = {"peak_gbps": {"h2d_pinned": 50.0, "d2h_pinned": 40.0, "h2d_pageable": 10.0}}
    overlap = {
        "modes": {
            "stage2": {"summary": {"median": {"gbps": {"h2d": 25.0, "d2h": 30.0}}}},
            "cpu-only": {"summary": {"median": {"gbps": {}}}},
        }
    }
    assert link_use(pcie, overlap) == [
        "- stage2: H2D 25.0 GB/s = 50% of 50.0; D2H 30.0 GB/s = 75% of 40.0"
    ]
    assert link_use({"skipped": "needs CUDA"}, overlap) == []


@pytest.mark.slow  # minutes of CPU training: scripts/test_slow.sh
def test_suite_runs_on_the_cpu(tmp_path: Path) -> None:
    """Sizes, then throughput at the largest size sizes found: every run trained, the report
    names the parts, and the throughput runs used accumulation and the mode filter."""
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_suite.py"), "--tiny", "--out",
         str(tmp_path), "--parts", "env", "sizes", "throughput", "throughput_large"],
        capture_output=True, text=True, timeout=3600, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    md = (tmp_path / "gpu_suite.md").read_text()
    assert "Largest model per mode" in md and "Throughput at the largest" in md
    sizes = json.loads((tmp_path / "sizes.json").read_text())
    assert {r["mode"] for r in sizes["rows"]} == {"stage0", "stage2+opt",
                                                  "stage3+opt+param"}  # fmt: skip
    for r in sizes["rows"]:
        assert r["params"] > 0 and r["step_s"] > 0, r
        if r["mode"] != "stage0":  # the host holds master + Adam state + grad (16 B/param)
            assert r["host_bytes_per_param"] == pytest.approx(r["formula_host_bytes_per_param"],
                                                              rel=0.05)  # fmt: skip
    thr = json.loads((tmp_path / "throughput.json").read_text())
    modes = {(r["impl"], r["stage"], r["offload"]) for r in thr["rows"]}
    assert modes == {("torch", 0, "-"), ("engine", 0, "-"), ("engine", 2, "cpu"),
                     ("engine", 2, "cpu+delayed"), ("engine", 3, "cpu+param")}  # fmt: skip
    assert all("error" not in r for r in thr["rows"])
    assert thr["meta"]["shape"]["gas"] == 4 and thr["meta"]["shape"]["checkpoint"]
    # Same model, data and recipe with accumulation and recompute: the same losses.
    ref = next(r for r in thr["rows"] if r["impl"] == "torch")["losses"]
    for r in thr["rows"]:
        if r["offload"] != "cpu+delayed":
            assert r["losses"] == pytest.approx(ref, rel=1e-4), r["offload"]
    large = json.loads((tmp_path / "throughput_large.json").read_text())
    assert (
        large["meta"]["shape"]["hidden"]
        == sizes["meta"]["ladder"][
            next(r for r in sizes["rows"] if r["mode"] == "stage2+opt")["rung"]
        ]["hidden"]
    )


def test_nvme_part_runs_on_the_cpu(tmp_path: Path) -> None:
    """The nvme part: disk, update path and a stage-3 step on NVMe against host offload, with
    equal losses, land in the report."""
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_suite.py"), "--tiny", "--out",
         str(tmp_path), "--parts", "env", "nvme", "--nvme-path", str(tmp_path / "swap")],
        capture_output=True, text=True, timeout=900, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    md = (tmp_path / "gpu_suite.md").read_text()
    assert "### NVMe offload (nvme_offload.py)" in md and "status: ok" in md
    assert "[disk]" in md and "[update]" in md
    assert "losses equal: True" in md
