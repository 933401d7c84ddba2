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

import gpu_check  # noqa: E402
import gpu_check_run as runner  # noqa: E402
import gpu_wheels_check  # noqa: E402
from gpu_check_steps import CAP_S, STEPS, cuda_test_files  # noqa: E402

WIRING = ("cuda_tests", "sanitizer", "pcie", "overlap", "throughput", "zenflow", "zenflow3")


def test_rehearsal_runs_every_step(tmp_path: Path) -> None:
    """On the CPU: install checked (nothing installed; scripts/gpu_rehearse.sh installs for
    real, offline), smoke passes, every CUDA step's wiring runs and is reported skipped, and
    OUTDIR holds at most 8 files, among them each step's details."""
    out = tmp_path / "check"
    env = dict(os.environ, PYTHON=sys.executable, GPU_CHECK_STATE=str(tmp_path / "state"))
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), str(out),
                           "--rehearsal"], capture_output=True, text=True, env=env,
                          timeout=600, cwd=REPO)  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    steps = {s["name"]: s for s in summary["steps"]}
    assert done.returncode == 0, (done.stdout[-3000:], summary)
    assert summary["mode"] == "cpu rehearsal"
    assert summary["pytest_timeout"] == (importlib.util.find_spec("pytest_timeout") is not None)
    names = [s.name for s in STEPS if s.default]
    assert list(steps) == names and "cpu_suite" not in names
    for s in summary["steps"]:
        assert set(s) >= {"name", "status", "seconds", "details"}, s
        assert s["seconds"] >= 0 and (out / s["details"]).is_file(), s
    assert {steps[n]["status"] for n in ("install", "smoke")} == {"passed"}
    for n in WIRING:
        assert steps[n]["status"] == "skipped" and "wiring" in steps[n]["note"], steps[n]
    assert steps["cuda_probes"]["status"] == "skipped"
    assert json.loads((tmp_path / "state" / "summary.json").read_text()) == summary
    assert len(list(out.rglob("*"))) <= 8
    assert "| step | status |" in done.stdout


def test_first_lease_figures_first_within_the_cap() -> None:
    """Install and smoke, then the figures, then the tests; every limit together within the
    cap; the ZenFlow rows with time to finish; no CPU suite and no required native build."""
    default = [s for s in STEPS if s.default]
    assert [s.name for s in default] == ["install", "smoke", "pcie", "throughput", "zenflow",
                                         "zenflow3", "overlap", "cuda_tests", "cuda_probes",
                                         "sanitizer"]  # fmt: skip
    assert sum(s.budget for s in default) <= CAP_S
    assert all(s.budget >= 45 for s in default if s.name.startswith("zenflow"))
    assert not any("ZERO_OFFLOAD_TEST_REQUIRE" in s.env for s in STEPS)


def test_a_step_gets_what_earlier_steps_left() -> None:
    assert gpu_check.step_limit(90, left=480, later=390) == 90
    assert gpu_check.step_limit(30, left=430, later=360) == 70  # the install's 40 s unused
    assert gpu_check.step_limit(65, left=50, later=45) == 50  # never past the cap
    assert gpu_check.step_limit(None, left=120, later=0) == 120


def _chosen(tmp_path: Path, monkeypatch, *argv: str) -> list[str]:
    monkeypatch.setenv("GPU_CHECK_STATE", str(tmp_path))
    args = gpu_check.parse_args([str(tmp_path / "out"), *argv])
    return [s.name for s in gpu_check.chosen_steps(args, tmp_path)]


def test_a_second_call_reruns_only_what_failed(tmp_path: Path, monkeypatch) -> None:
    """``--failed`` reads the last summary kept on the machine: the failed, timed-out and
    unreached steps run again, install first only where it has not passed there."""
    entries = [runner.entry("install", "passed", 1, "install.log"),
               runner.entry("smoke", "passed", 1, "install.log"),
               runner.entry("pcie", "failed", 1, "bench.log"),
               runner.entry("throughput", "timed out", 1, "bench.log"),
               runner.entry("zenflow", "skipped", 0, "bench.log", note="no time left"),
               runner.entry("zenflow3", "skipped", 0, "bench.log", note="no CUDA")]  # fmt: skip
    chosen = [s.name for s in STEPS if s.default]
    (tmp_path / "summary.json").write_text(json.dumps({"chosen": chosen, "steps": entries}))
    again = ["pcie", "throughput", "zenflow", "overlap", "cuda_tests", "cuda_probes", "sanitizer"]
    assert _chosen(tmp_path, monkeypatch, "--failed") == ["install", *again]
    (tmp_path / "installed").write_text("python3\n")
    assert _chosen(tmp_path, monkeypatch, "--failed") == again
    monkeypatch.setenv("GPU_CHECK_STEPS", "sanitizer,cuda_tests")
    assert _chosen(tmp_path, monkeypatch) == ["cuda_tests", "sanitizer"]
    monkeypatch.setenv("GPU_CHECK_STEPS", "sanitiser")
    with pytest.raises(SystemExit, match="unknown step"):
        _chosen(tmp_path, monkeypatch)
    monkeypatch.delenv("GPU_CHECK_STEPS")
    (tmp_path / "summary.json").unlink()
    with pytest.raises(SystemExit, match="no earlier summary"):
        _chosen(tmp_path, monkeypatch, "--failed")


def test_smoke_trains_when_nccl_init_fails(monkeypatch, capsys) -> None:
    """A GPU machine whose NCCL cannot make a group: smoke says so (and fails), and its step
    still trains, as a world of one with no process group."""
    import gpu_smoke
    import torch.distributed as dist

    def refuse(*args, **kwargs):
        raise RuntimeError("NCCL error: unhandled system error")

    monkeypatch.setattr(dist, "init_process_group", refuse)
    monkeypatch.setattr(gpu_smoke, "devices", lambda: {"torch": "x", "cuda": True, "gpu": "-"})
    monkeypatch.delenv("MASTER_PORT", raising=False)
    assert gpu_smoke.main() == 1
    printed = capsys.readouterr().out
    got = json.loads(next(ln for ln in printed.splitlines() if ln.startswith("SMOKE {"))[6:])
    assert got["nccl"].startswith("failed: RuntimeError: NCCL error"), got
    assert len(got["step"]["losses"]) == 2 and not got["step"]["process_group"]
    assert "SMOKE problem: nccl: failed" in printed and "MASTER_PORT" not in os.environ


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


def _wheel(folder: Path, name: str, version: str, requires: str = "") -> None:
    import zipfile

    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", f"Name: {name}\n{requires}")


def test_wheels_check_names_what_the_install_lacks(tmp_path: Path) -> None:
    """.whl/ before a lease: every wheel the install needs, one version each, typing_extensions
    as new as pydantic asks."""
    for name in gpu_wheels_check.NEEDED:
        _wheel(tmp_path, name, "1.0")
    _wheel(tmp_path, "pydantic", "2.13.4", "Requires-Dist: typing-extensions>=4.14.1\n")
    (tmp_path / "pydantic-1.0-py3-none-any.whl").unlink()
    assert gpu_wheels_check.problems(tmp_path) == [
        "typing_extensions (1, 0) is older than pydantic's >= (4, 14, 1)"
    ]
    (tmp_path / "typing_extensions-1.0-py3-none-any.whl").unlink()
    _wheel(tmp_path, "typing_extensions", "4.16.0")
    _wheel(tmp_path, "wheel", "0.48.0")
    (tmp_path / "annotated_types-1.0-py3-none-any.whl").unlink()
    found = gpu_wheels_check.problems(tmp_path)
    assert found[0] == f"annotated_types: none in {tmp_path}"
    assert found[1].startswith("wheel: 2 versions") and len(found) == 2
