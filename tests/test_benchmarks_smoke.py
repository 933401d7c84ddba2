"""Smoke tests of the benchmarks: the step benchmark's quick run finishes, prints the table, and every
row trained the same model to the same loss (a row that measured something else would not); the
overlap benchmark's CPU run writes a trace and a summary for every mode."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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


@pytest.mark.slow  # a benchmark script end to end: scripts/test_slow.sh
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
        timeout=600,  # a hang guard only: about 45 s on 2 idle cores
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


@pytest.mark.slow  # a benchmark script end to end: scripts/test_slow.sh
def test_overlap_trace_on_cpu(tmp_path: Path) -> None:
    """The overlap benchmark's plumbing on the CPU: every mode runs in its own process, writes a
    gzipped trace and its per-step summary; without GPU events only host columns are filled."""
    import gzip

    out = tmp_path / "traces"
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "overlap_trace.py"), "--device", "cpu",
         "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard only: about 8 s on 2 idle cores
        cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    header = next(ln for ln in lines if ln.startswith("| mode |"))
    for col in ("step ms", "GPU compute %", "H2D %", "D2H %", "host update %", "H2D GB/s"):
        assert col in header
    modes = ("stage2", "stage2-delayed", "stage3")
    rows = [ln for ln in lines if ln.startswith(tuple(f"| {m} |" for m in modes))]
    assert len(rows) == 3, "\n".join(lines)

    data = json.loads((out / "summary.json").read_text())
    assert data["meta"]["device"] == "cpu"
    assert list(data["modes"]) == list(modes)
    for mode, r in data["modes"].items():
        assert "error" not in r, (mode, r)
        assert r["step_ms_median"] > 0 and all(math.isfinite(x) for x in r["losses"])
        s = r["summary"]
        assert not s["has_gpu"]
        assert len(s["steps"]) == data["meta"]["profile_steps"], mode
        assert "host_update" in s["classes"], mode
        for step in s["steps"]:
            assert all(0.0 <= v <= 1.0 for v in step["busy_frac"].values()), (mode, step)
        trace = Path(r["trace"])
        assert trace.parent == out.resolve() and 0 < trace.stat().st_size < 10 * 2**20
        with gzip.open(trace, "rt") as f:
            assert json.load(f)["traceEvents"]
    assert data["modes"]["stage2-delayed"]["host_update_thread_spans"] > 0
    assert data["modes"]["stage2"]["host_update_thread_spans"] == 0
    assert "fetch" in data["modes"]["stage3"]["summary"]["classes"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_overlap_trace_on_cuda_reads_the_gpu_events(tmp_path: Path) -> None:
    """On a GPU: the trace's kernels and copies are found where ``_trace.py`` expects them (the
    "kernel" and "gpu_memcpy" categories, "Memcpy HtoD/DtoH" names, ``args.bytes``), and a stage-2
    offload step moves its bf16 gradients down and its bf16 params up once."""
    out = tmp_path / "traces"
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "overlap_trace.py"), "--device", "cuda",
         "--layers", "2", "--hidden", "256", "--heads", "4", "--seq", "128", "--micro", "2",
         "--warmup", "2", "--steps", "2", "--profile-steps", "2", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,  # a hang guard within one GPU command (seconds there)
        cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((out / "summary.json").read_text())
    for mode, r in data["modes"].items():
        assert "error" not in r, (mode, r)
        s = r["summary"]
        assert s["has_gpu"], (mode, s["categories"])
        assert {"compute", "h2d"} <= set(s["classes"]), (mode, s["classes"], s["copy_names"])
        for step in s["steps"]:
            assert all(0.0 <= v <= 1.0 for v in step["busy_frac"].values()), (mode, step)
            assert all(v is not None for v in step["bytes"].values()), (mode, step["bytes"])
    two = data["modes"]["stage2"]
    grad_bytes = 2 * two["params"]  # bf16, world 1: every gradient goes down once per step
    moved = two["summary"]["median"]["bytes"]
    assert grad_bytes <= moved["d2h"] <= 1.05 * grad_bytes, (moved, grad_bytes)
    assert grad_bytes <= moved["h2d"] <= 1.05 * grad_bytes, (moved, grad_bytes)
    assert data["modes"]["stage2-delayed"]["host_update_thread_spans"] > 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_overlap_trace_attributes_copies_to_the_labels(tmp_path: Path) -> None:
    """On a GPU: each copy's ``correlation`` id leads to the runtime call and the label around it
    (grad copies to ``zero_offload.grad_d2h``, param uploads to ``zero_offload.param_h2d``)."""
    out = tmp_path / "traces"
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "overlap_trace.py"), "--device", "cuda",
         "--modes", "stage2", "--layers", "2", "--hidden", "256", "--heads", "4", "--seq", "128",
         "--micro", "2", "--warmup", "2", "--steps", "1", "--profile-steps", "1",
         "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,  # a hang guard within one GPU command (seconds there)
        cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    step = json.loads((out / "summary.json").read_text())["modes"]["stage2"]["summary"]["steps"][0]
    by = step["bytes_by_issuer"]
    assert max(by["d2h"], key=by["d2h"].get) == "zero_offload.grad_d2h", by
    assert max(by["h2d"], key=by["h2d"].get) == "zero_offload.param_h2d", by


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pcie_bandwidth_on_cuda(tmp_path: Path) -> None:
    out = tmp_path / "pcie.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "pcie_bandwidth.py"), "--min", "1MiB",
         "--max", "4MiB", "--repeats", "3", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert "skipped" not in data
    for kind, rows in data["kinds"].items():
        assert len(rows) == 3 and all(r["gbps"] > 0 for r in rows.values()), (kind, rows)
    assert "| **peak** |" in done.stdout


@pytest.mark.slow  # a benchmark script end to end: scripts/test_slow.sh
def test_nvme_offload_benchmark_runs(tmp_path: Path) -> None:
    """The NVMe benchmark's quick run: disk, update path and a step on each placement; the NVMe
    run trains to the host-offload run's losses."""
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "nvme_offload.py"),
            "--path",
            str(tmp_path),
            "--disk-gib",
            "0.01",
            "--update-m",
            "1",
            "--reps",
            "1",
            "--dim",
            "64",
            "--layers",
            "2",
            "--steps",
            "2",
            "--skip",
            "cap",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for section in ("[disk]", "[update]", "[step]"):
        assert section in done.stdout, done.stdout
    assert "losses equal: True" in done.stdout, done.stdout
    assert not any(tmp_path.rglob("*.swp"))


def test_memory_model_benchmark_row(tmp_path: Path) -> None:
    """One row of the memory benchmark: the worker measures a step and the engine's prediction
    is printed beside it (allocated bytes from the allocator's events, not RSS)."""
    out = tmp_path / "rows.json"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "memory_model.py"),
            "--sizes",
            "small",
            "--placements",
            "stage3-cpu",
            "--json",
            str(out),
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=600,
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = json.loads(out.read_text())
    ours = row["ours"]
    predicted = ours["predicted"]["peak.device.total"] + ours["predicted"]["peak.host.total"]
    assert 0.8 < (ours["states"] + ours["working"]) / predicted < 1.2
    assert "stage3-cpu" in done.stdout


def test_grad_norm_benchmark_quick() -> None:
    """The norm benchmark's quick run: both paths of the kernel table, and the engine table
    before and after with the same losses (the norm only feeds the clip factor)."""
    from zero_offload.kernels.sumsq import kernel_available

    if not kernel_available():
        pytest.skip("the compiled sum-of-squares kernel is not built")
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "grad_norm.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "| 1M | bf16 |" in out and "| 1M | fp32 |" in out, out
    assert "| torch (before) |" in out and "| kernel (after) |" in out, out
    before = next(ln for ln in out.splitlines() if ln.startswith("losses before:"))
    after = next(ln for ln in out.splitlines() if ln.startswith("losses after:"))
    assert before.split(":")[1].split() == after.split(":")[1].split(), out


@pytest.mark.slow  # a benchmark script end to end: scripts/test_slow.sh
def test_nvme_step_benchmark_runs(tmp_path: Path) -> None:
    """The NVMe step comparison's quick run (this library's side): the disk (one direction and
    mixed), the floors, the step and its disk timeline are printed, and the swap files are gone
    after it."""
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "nvme_step.py"),
            "--path",
            str(tmp_path),
            "--disk-gib",
            "0.01",
            "--dim",
            "64",
            "--layers",
            "2",
            "--steps",
            "2",
            "--dtype",
            "fp32",
            "--trace",
            str(tmp_path / "io.jsonl"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    parts = ("[disk]", "[disk, mixed]", "[floor]", "zero_offload     median step")
    parts += ("ours / floor (state+params, the goal's)", "[disk timeline of ours]", "disk busy")
    for part in parts:
        assert part in done.stdout, done.stdout
    assert not any(tmp_path.rglob("*.swp"))


def test_host_account_benchmark_runs() -> None:
    """The host-memory account at a tiny size (this library's side): every term of the report,
    their sum and the measured peak are printed, and the states include the aliased master's
    absence (stage 3, both offloads, fp32: no ``host.master_shard``)."""
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "host_account.py"), "--hidden", "64",
         "--layers", "1", "--vocab", "256", "--steps", "2"],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "| host.optimizer_state |" in out and "| sum of the terms |" in out, out
    assert "host.master_shard" not in out and "terms / measured:" in out, out


def test_max_model_benchmark_runs() -> None:
    """The largest-model search at a toy size (this library's side, host offload): it searches
    the toy ladder, and every rung fits, so the largest is the top one with no next rung."""
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "max_model.py"), "--tiny", "--cap-gib", "3",
         "--engines", "zero_offload", "--placements", "cpu"],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| zero_offload | cpu | fp32 | 0.00B (4 x 64) |" in done.stdout, done.stdout


@pytest.mark.slow
def test_max_model_compact_states_tiny() -> None:
    """``--states``: the 8-bit format's search trains the toy ladder in bf16 (ours), DeepSpeed's
    8-bit row is "not offered" without running it, and the host account's child runs the same
    format (DeepSpeed not offered there either)."""
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "max_model.py"), "--tiny", "--states", "8bit",
         "--engines", "zero_offload", "deepspeed", "--placements", "cpu", "--steps", "2"],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "| zero_offload | cpu | 8bit | 0.00B (4 x 64) |" in out, out
    assert "| deepspeed | cpu | 8bit | not offered (DeepSpeed 0.19.8 has no 8bit" in out, out
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "host_account.py"), "--hidden", "64",
         "--layers", "1", "--vocab", "256", "--steps", "2", "--states", "8bit", "--deepspeed"],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "bf16 training, 8bit states" in done.stdout, done.stdout
    assert "| host.optimizer_state |" in done.stdout, done.stdout
    assert "DeepSpeed: not offered" in done.stdout, done.stdout


def test_max_model_dry_run_agrees_with_the_estimate() -> None:
    """``--dry-run`` on the real ladder (19 GiB, host offload) runs no attempt: per format the
    memory model's plan holds that format, and ``zero-offload estimate --max-model``'s largest
    is within 10% of the memory model's largest rung (the issue's goal for the estimate)."""
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "max_model.py"), "--dry-run", "--cap-gib",
         "19", "--placements", "cpu", "--states", "fp32", "bf16", "8bit"],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    for name in ("fp32", "bf16", "8bit+bf16"):
        assert f"the memory model's plan: state {name}," in out, out
    assert "deepspeed: not offered" in out, out
    ratios = [float(line.split()[-1]) for line in out.splitlines() if "estimate / memory" in line]
    assert len(ratios) == 3 and all(0.9 <= r <= 1.1 for r in ratios), out


@pytest.mark.slow  # a benchmark script end to end: scripts/test_slow.sh
def test_launch_account_benchmark_runs() -> None:
    """The 2-rank ``launch ... train --model`` account at a tiny size: the train summary's terms,
    the import baseline, their sum and each rank's measured peak are printed."""
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "launch_account.py"), "--hidden", "64",
         "--layers", "1", "--vocab", "256", "--steps", "2"],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "| peak.host.allocator_free |" in out and "| baseline of an import |" in out, out
    assert "rank 0: peak anonymous RSS" in out and "rank 1: peak anonymous RSS" in out, out


@pytest.mark.slow  # a benchmark script end to end: scripts/test_slow.sh
def test_nvme_host_bound_benchmark_runs(tmp_path) -> None:
    """The NVMe host-memory bound at a tiny size (this library's side): what the config allows
    by term, the report and the measured peak against the bound are printed."""
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "nvme_host_bound.py"), "--path", str(tmp_path),
         "--hidden", "64", "--layers", "1", "--vocab", "256", "--steps", "2", "--seq", "16"],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| fp32 gradient partition |" in done.stdout, done.stdout
    assert "x what the config allows" in done.stdout, done.stdout


@pytest.mark.slow  # a benchmark script end to end: scripts/test_slow.sh
def test_zenflow_step_benchmark_quick(tmp_path: Path) -> None:
    """The three rows (plain offload, ZenFlow, DeepSpeed's ZenFlow) train the same model from
    the same data (equal first loss), ZenFlow is not plain offload (later losses differ), and the
    table shows each row's ratios; no timing is asserted."""
    out = tmp_path / "zenflow.json"
    # DeepSpeed's row where DeepSpeed is installed (CI installs it); the two others always
    import importlib.util

    expected = {"offload", "zenflow"}
    if importlib.util.find_spec("deepspeed") is not None:
        expected.add("deepspeed zenflow")
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "zenflow_step.py"),
            "--quick",
            "--json",
            str(out),
            "--rows",
            *sorted(expected),
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard only: about 25 s on 2 idle cores
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-2000:]
    assert done.stdout.startswith("CPU: ")
    assert "| row | s/step median | IQR | s/step mean | x offload | x DS zenflow |" in done.stdout
    rows = {r["row"]: r for r in json.loads(out.read_text())}
    assert set(rows) == expected
    first = {r["losses"][0] for r in rows.values()}
    assert len(first) == 1, first
    assert rows["zenflow"]["losses"][1:] != rows["offload"]["losses"][1:]
    assert all(len(r["wall"]) == 3 for r in rows.values())


def test_json_holds_each_row_as_it_finishes(tmp_path: Path, monkeypatch) -> None:
    """The GPU check stops the throughput step at its limit: the rows finished before that are
    in the JSON already (the second run here is interrupted as the limit would)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import engine_step

    calls: list[str] = []

    def launch_then_stop(shape, run, *args):
        calls.append(run.impl)
        if len(calls) > 1:
            raise KeyboardInterrupt  # what the step's SIGINT raises in the benchmark
        return real(shape, run, *args)

    real = engine_step.launch
    monkeypatch.setattr(engine_step, "launch", launch_then_stop)
    out = tmp_path / "throughput.json"
    argv = ["--quick", "--world", "1", "--stages", "2", "--modes", "2:cpu", "--impls", "torch",
            "engine", "--no-deepspeed", "--json", str(out)]  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        engine_step.main(argv)
    assert calls == ["torch", "engine"]
    rows = json.loads(out.read_text())["rows"]
    assert [r["impl"] for r in rows] == ["torch"] and rows[0]["median_s"] > 0


def test_max_model_environment_failure_stops_the_search(monkeypatch) -> None:
    """An attempt failing for a reason no smaller rung avoids (DeepSpeed's NVMe swapper without
    its async_io op) ends that search as "failed" after that one attempt; a size failure (the
    cgroup's OOM killer) only moves the search down the ladder."""
    import argparse

    sys.path.insert(0, str(REPO / "benchmarks"))
    import max_model

    broken = "DeepSpeed's async_io op cannot load (its NVMe swapper needs libaio-dev)"
    tried: list[int] = []

    def fake(args, engine, layers, hidden):
        tried.append(layers)
        row = {"layers": layers, "hidden": hidden, "params": layers, "states": args.states}
        if args.kind == "broken":
            return row | {"error": broken, "broken": True}
        return row | ({"error": "killed by the cgroup's OOM killer"} if layers > 2 else {})

    monkeypatch.setattr(max_model, "attempt", fake)
    args = argparse.Namespace(start_layers=0, tiny=True, offload="nvme", sub_group=0,
                              states="bf16", vocab=128, seq=32, cap_gib=1.0, disk_free=float("inf"),
                              bucket=1e5, live=1e5, nvme_path="", kind="broken")  # fmt: skip
    r = max_model.largest(args, "deepspeed", max_model.TINY_LADDER)
    assert r["failed"] == broken and len(tried) == 1, (r, tried)
    assert f"| deepspeed | nvme | bf16 | failed: {broken} |" in max_model._row(r, [r], args)
    tried.clear()
    args.kind = "oom"
    r = max_model.largest(args, "deepspeed", max_model.TINY_LADDER)
    assert "failed" not in r and r["fit"]["layers"] == 2 and r["next"]["layers"] == 3, r
