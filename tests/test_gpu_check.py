"""The GPU check (``scripts/gpu_check.sh``) between GPU leases: its CPU rehearsal runs every
step's wiring, so the script cannot rot while no GPU is there; the pieces that decide a step's
status; and the CPU tests' view of a machine with a GPU (none)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import gpu_check_run as runner  # noqa: E402
from gpu_check_steps import STEPS, cuda_test_files  # noqa: E402

WIRING = ("cuda_tests", "sanitizer", "pcie", "overlap", "throughput", "zenflow", "zenflow3")


def test_rehearsal_runs_every_step(tmp_path: Path) -> None:
    """On the CPU: install checked (nothing installed), smoke and a few CPU tests pass, every
    CUDA step's wiring runs and is reported skipped, and OUTDIR holds at most 8 files, among them
    each step's details."""
    out = tmp_path / "check"
    env = dict(os.environ, PYTHON=sys.executable)
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), str(out),
                           "--rehearsal"], capture_output=True, text=True, env=env,
                          timeout=600, cwd=REPO)  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    steps = {s["name"]: s for s in summary["steps"]}
    assert done.returncode == 0, (done.stdout[-3000:], summary)
    assert summary["mode"] == "cpu rehearsal"
    assert summary["pytest_timeout"] == (importlib.util.find_spec("pytest_timeout") is not None)
    names = [s.name for s in STEPS]
    assert [n for n in steps if n != "deepspeed_build"] == names
    for s in summary["steps"]:
        assert set(s) >= {"name", "status", "seconds", "details"}, s
        assert s["seconds"] >= 0 and (out / s["details"]).is_file(), s
    assert {steps[n]["status"] for n in ("install", "smoke", "cpu_suite")} == {"passed"}
    for n in WIRING:
        assert steps[n]["status"] == "skipped" and "wiring" in steps[n]["note"], steps[n]
    assert steps["cpu_suite"]["result"].endswith("passed")
    assert steps["cuda_probes"]["status"] == "skipped"
    assert len(list(out.rglob("*"))) <= 8
    assert "| step | status |" in done.stdout


def test_cuda_test_files_leave_out_probes_and_sanitizer() -> None:
    files = cuda_test_files(REPO)
    assert "tests/test_cuda.py" in files and "tests/test_offload_states_cuda.py" in files
    assert not any("cuda_probes" in f or "cuda_sanitizer" in f for f in files)


@pytest.mark.parametrize(
    "rc,tail,skipped_ok,want",
    [
        (0, "12 passed in 3.10s\n", False, "passed"),
        (0, "== 11 passed, 1 skipped in 3.10s ==\n", False, "failed"),
        (0, "11 passed, 1 skipped in 3.10s\n", True, "passed"),
        (1, "1 failed, 11 passed in 3.10s\n", True, "failed"),
        (5, "no tests ran in 0.01s\n", False, "skipped"),
        (None, "....", True, "timed out"),
    ],
)
def test_step_status(rc, tail, skipped_ok, want) -> None:
    assert runner.status_of(runner.Outcome(rc, 1.0, tail), skipped_ok) == want


def test_pytest_result_is_the_last_summary_line() -> None:
    tail = "3 passed in 1.00s\n...\n== 1 failed, 2 passed, 1 skipped in 9.50s ==\n"
    assert runner.pytest_result(tail) == "1 failed, 2 passed, 1 skipped"
    assert runner.pytest_result("Traceback ...") is None
    collected = "30/61 tests collected (31 deselected) in 3.02s\n"
    assert runner.pytest_result(collected) == "30/61 tests collected (31 deselected)"


def test_cpu_tests_see_no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a machine with a GPU a CPU test sees none: torch.cuda says so in the process, and the
    processes it starts inherit CUDA_VISIBLE_DEVICES="" (tests/conftest.py)."""
    from cuda_visibility import hide_cuda

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    hide_cuda(monkeypatch)
    assert not torch.cuda.is_available() and torch.cuda.device_count() == 0
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""


def test_hf_route_subprocesses_see_no_gpu() -> None:
    helpers = pytest.importorskip("hf_route_helpers")
    env = helpers.clean_env()
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["ZERO_OFFLOAD_DEVICE"] == "cpu"


def test_step_over_its_limit_is_stopped(tmp_path: Path) -> None:
    """A command past its limit is ended (SIGINT, then SIGKILL of its group) and reported timed
    out; what it printed before stays in its log."""
    log = tmp_path / "step.log"
    cmd = ["bash", "-c", "echo started; sleep 60"]
    got = runner.run(cmd, log, timeout=3.0, env=dict(os.environ), cwd=tmp_path)
    assert got.rc is None and runner.status_of(got) == "timed out"
    assert "started" in log.read_text() and got.seconds < 60
