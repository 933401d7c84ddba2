"""The GPU check: the steps of ``gpu_check_steps.py`` in order, each under its own time limit and
all under one cap (default ``CAP_S``, 480 s, on a GPU; 420 s for the CPU rehearsal), writing
``OUTDIR/summary.json`` after every step (a cut-off run keeps the finished steps' results), each
step's output into its log in OUTDIR, the steps' data files into ``OUTDIR/data.tgz``, and a table
last. A copy of the summary and what the install left for later steps (the ``PYTHONPATH`` of its
fallback) stay on the machine in ``$GPU_CHECK_STATE`` (default /tmp/zero_offload_gpu_check), so
that a second call on the same machine reruns only what failed (``--failed``). Run it through
``scripts/gpu_check.sh`` (docs/gpu.md)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import gpu_check_run as runner
from gpu_check_steps import CAP_S, STEPS, Ctx, Step

REPO = Path(__file__).resolve().parents[1]
MIN_STEP_S = 20.0  # a step that would get less is skipped
REHEARSAL_MIN_S = {"install": 150.0, "*": 60.0}  # a step's limit at least, in the rehearsal
REHEARSAL_CAP_S = 420.0  # the rehearsal's default cap (gpu_check.sh's backstop is 540 s)
STATE_ENV = "GPU_CHECK_STATE"  # the folder that outlives a call on the same machine
STEPS_ENV = "GPU_CHECK_STEPS"  # steps to run, as --steps (space- or comma-separated)
RERUN = ("failed", "timed out")  # a step with this status is rerun by --failed


def state_dir() -> Path:
    return Path(os.environ.get(STATE_ENV) or "/tmp/zero_offload_gpu_check")


def install_pythonpath(state: Path) -> str | None:
    """The folders the install put on ``PYTHONPATH`` (its fallback when the interpreter's
    environment is not writable: scripts/gpu_install.sh writes them there), else None."""
    f = state / "pythonpath"
    return f.read_text().strip() or None if f.is_file() else None


def probe(python: str, code: str) -> bool:
    """Whether ``code`` exits 0 in a fresh interpreter (what the steps will see)."""
    done = subprocess.run([python, "-c", code], capture_output=True, timeout=120, cwd=REPO)
    return done.returncode == 0


def make_ctx(args: argparse.Namespace, scratch: Path) -> Ctx:
    cuda = not args.rehearsal and probe(args.python, "import sys, torch; "
                                        "sys.exit(not torch.cuda.is_available())")  # fmt: skip
    return Ctx(
        python=args.python,
        repo=REPO,
        scratch=scratch,
        cuda=cuda,
        xdist=probe(args.python, "import xdist"),
        timeout_plugin=probe(args.python, "import pytest_timeout"),
        install=args.install,
    )


def step_env(ctx: Ctx, step: Step, state: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TORCH_EXTENSIONS_DIR="/tmp/torch_ext")
    env["PYTHON"] = ctx.python
    env[STATE_ENV] = str(state)
    if not ctx.cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the rehearsal, forced on a GPU machine too
    env.update(step.env)
    extra = install_pythonpath(state)
    if extra:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (extra, env.get("PYTHONPATH")) if p)
    return env


def rehearsal_budget(step: Step) -> float | None:
    """The rehearsal's CPU compiles, collects and imports slower than the GPU machine's 16
    cores: its steps get at least REHEARSAL_MIN_S each (the GPU limits are sized for that one)."""
    if step.budget is None:
        return None
    return max(step.budget, REHEARSAL_MIN_S.get(step.name, REHEARSAL_MIN_S["*"]))


def step_limit(budget: float | None, left: float, later: float) -> float:
    """A step's limit: its own budget, plus what earlier steps left unused (``left`` less the
    ``later`` steps' budgets), never more than ``left``; None: all that is left."""
    if budget is None:
        return left
    return min(left, max(budget, left - later))


def run_step(
    step: Step, ctx: Ctx, out: Path, left: float, state: Path, later: float = 0.0
) -> dict[str, Any]:
    """One step: its command, or skipped (nothing to run, no time left). ``later``: the
    budgets of the chosen steps after it (what it must leave them)."""
    log = out / step.log
    with open(log, "a") as f:
        f.write(f"\n==== {step.name}\n")
    cmd = step.command(ctx)
    if cmd is None:
        return runner.entry(
            step.name, "skipped", 0.0, step.log, note="no tests there (no test_*.py)"
        )
    budget = rehearsal_budget(step) if not ctx.cuda else step.budget
    limit = step_limit(budget, left, later)
    if limit < MIN_STEP_S:
        return runner.entry(step.name, "skipped", 0.0, step.log, note="no time left")
    res = runner.run(cmd, log, limit - runner.GRACE_S, step_env(ctx, step, state), REPO)
    status = runner.status_of(res, skipped_ok=step.skipped_ok or not ctx.cuda)
    if step.cuda and not ctx.cuda and status in ("passed", "skipped"):
        status, note = "skipped", "no CUDA: only the step's wiring ran"
    else:
        note = None
    return runner.entry(step.name, status, res.seconds, step.log, note=note,
                        result=runner.pytest_result(res.tail), problems=res.notes)  # fmt: skip


def pack(ctx: Ctx, out: Path, steps: tuple[Step, ...]) -> None:
    """The steps' data files so far into ``OUTDIR/data.tgz`` (written whole, then renamed)."""
    names = [n for s in steps for n in s.data if (ctx.scratch / n).exists()]
    if not names:
        return
    tmp = out / "data.tgz.part"
    with tarfile.open(tmp, "w:gz") as tar:
        for n in names:
            tar.add(ctx.scratch / n, arcname=n)
    tmp.replace(out / "data.tgz")


def write_summary(out: Path, meta: dict[str, Any], steps: list[dict[str, Any]]) -> None:
    tmp = out / "summary.json.part"
    tmp.write_text(json.dumps({**meta, "steps": steps}, indent=1) + "\n")
    tmp.replace(out / "summary.json")


def table(steps: list[dict[str, Any]], total: float) -> str:
    rows = ["| step | status | s | details |", "| --- | --- | ---: | --- |"]
    for s in steps:
        what = "; ".join(s[k] for k in ("result", "note") if s.get(k))
        rows.append(f"| {s['name']} | {s['status']} | {s['seconds']:.0f} | {s['details']}"
                    f"{': ' + what if what else ''} |")  # fmt: skip
    return "\n".join(rows + [f"total {total:.0f} s"])


def chosen_steps(args: argparse.Namespace, state: Path) -> list[Step]:
    """The steps to run: ``--steps`` (or ``$GPU_CHECK_STEPS``), or with ``--failed`` those the
    last call on this machine left failed, timed out or unreached, else every default step; in
    the check's order. A call on a machine whose install has not passed installs first."""
    names = args.steps or os.environ.get(STEPS_ENV, "").replace(",", " ").split() or None
    known = {s.name for s in STEPS}
    if names is not None and set(names) - known:
        raise SystemExit(f"{STEPS_ENV} / --steps: unknown step(s) {sorted(set(names) - known)}; "
                         f"the steps are {[s.name for s in STEPS]}")  # fmt: skip
    if args.failed:
        last = state / "summary.json"
        if not last.is_file():
            raise SystemExit(f"--failed: no earlier summary on this machine ({last}); name the "
                             f"steps with --steps or {STEPS_ENV}")  # fmt: skip
        summary = json.loads(last.read_text())
        ran = {e["name"]: e for e in summary["steps"]}
        again = {
            n for n, e in ran.items() if e["status"] in RERUN or e.get("note") == "no time left"
        }
        names = [n for n in summary.get("chosen", ran) if n in again or n not in ran]
    if names is None:
        return [s for s in STEPS if s.default]
    if not names:
        return []  # --failed after a call that left nothing to rerun
    if "install" not in names and not (state / "installed").is_file():
        names = ["install", *names]
    return [s for s in STEPS if s.name in names]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="folder for summary.json, the logs and data.tgz")
    p.add_argument("--rehearsal", action="store_true", help="the CPU rehearsal even with CUDA")
    p.add_argument("--cap", type=float, default=None, help="seconds for the whole check "
                   f"(default {CAP_S:.0f} on a GPU, {REHEARSAL_CAP_S:.0f} for the rehearsal)")  # fmt: skip
    p.add_argument(
        "--steps",
        nargs="+",
        choices=[s.name for s in STEPS],
        default=None,
        help=f"only these steps (default: all but cpu_suite; also ${STEPS_ENV})",
    )
    p.add_argument("--failed", action="store_true", help="only the steps the last call on "
                   "this machine left failed, timed out or unreached")  # fmt: skip
    p.add_argument("--install", action="store_true", help="the rehearsal installs for real "
                   "(scripts/gpu_rehearse.sh) instead of checking the install")  # fmt: skip
    p.add_argument("--python", default=os.environ.get("PYTHON", "python3"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    state = state_dir()
    chosen = chosen_steps(args, state)
    state.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    ctx = make_ctx(args, scratch)
    cap = args.cap or (CAP_S if ctx.cuda else REHEARSAL_CAP_S)
    meta = {"mode": "gpu" if ctx.cuda else "cpu rehearsal", "cap_s": cap, "python": ctx.python,
            "pytest_timeout": ctx.timeout_plugin, "xdist": ctx.xdist,
            "chosen": [s.name for s in chosen]}  # fmt: skip
    done: list[dict[str, Any]] = []
    try:
        for i, step in enumerate(chosen):
            if step.name == "install":  # installed again, or no longer
                (state / "installed").unlink(missing_ok=True)
            left = cap - (time.monotonic() - t0)
            later = sum((rehearsal_budget(s) if not ctx.cuda else s.budget) or 0.0
                        for s in chosen[i + 1 :])  # fmt: skip
            done.append(run_step(step, ctx, out, left, state, later))
            print(f"== {step.name}: {done[-1]['status']} ({done[-1]['seconds']:.0f} s)", flush=True)
            if step.name == "install" and done[-1]["status"] == "passed":
                (state / "installed").write_text(ctx.python + "\n")
            pack(ctx, out, tuple(chosen))
            write_summary(out, {**meta, "seconds": round(time.monotonic() - t0, 1)}, done)
            shutil.copyfile(out / "summary.json", state / "summary.json")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(table(done, time.monotonic() - t0))
    return 0 if all(s["status"] in ("passed", "skipped") for s in done) else 1


if __name__ == "__main__":
    sys.exit(main())
