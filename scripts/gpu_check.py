"""The GPU check: the steps of ``gpu_check_steps.py`` in order, each under its own time limit and
all under one cap (default 480 s on a GPU, 300 s for the CPU rehearsal), writing
``OUTDIR/summary.json`` after every step (a cut-off run keeps the finished steps' results), each
step's output into its log in OUTDIR, the steps' data files into ``OUTDIR/data.tgz``, and a table
last. Run it through ``scripts/gpu_check.sh`` (docs/gpu.md)."""

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
from gpu_check_steps import STEPS, Ctx, Step

REPO = Path(__file__).resolve().parents[1]
MIN_STEP_S = 20.0  # a step that would get less is skipped
DS_SITE = "/tmp/site_ds"  # where scripts/gpu_install.sh puts DeepSpeed
DS_BUILD = "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"


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
    )


def step_env(ctx: Ctx, step: Step) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TORCH_EXTENSIONS_DIR="/tmp/torch_ext")
    env["PYTHON"] = ctx.python
    if not ctx.cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the rehearsal, forced on a GPU machine too
    env.update(step.env)
    if step.name == "throughput" and ctx.ds_ready:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (DS_SITE, env.get("PYTHONPATH")) if p)
    return env


def run_step(step: Step, ctx: Ctx, out: Path, left: float) -> dict[str, Any]:
    """One step: its command, or skipped (nothing to run, no time left)."""
    log = out / step.log
    with open(log, "a") as f:
        f.write(f"\n==== {step.name}\n")
    cmd = step.command(ctx)
    if cmd is None:
        return runner.entry(
            step.name, "skipped", 0.0, step.log, note="no tests there (no test_*.py)"
        )
    limit = left if step.budget is None else min(step.budget, left)
    if limit < MIN_STEP_S:
        return runner.entry(step.name, "skipped", 0.0, step.log, note="no time left")
    res = runner.run(cmd, log, limit - runner.GRACE_S, step_env(ctx, step), REPO)
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


class DeepSpeedBuild:
    """DeepSpeed's CPU Adam JIT-compiled in the background while the GPU tests run (on the
    CPU's spare cores, at low priority), so that the throughput row can compare with DeepSpeed
    where the build finishes in time; stopped when the throughput step starts."""

    def __init__(self, ctx: Ctx) -> None:
        self.proc: subprocess.Popen | None = None
        self.log = ctx.scratch / "deepspeed_build.log"
        self.t0 = time.monotonic()
        if not ctx.cuda or not Path(DS_SITE, "deepspeed").is_dir():
            return
        env = dict(os.environ, PYTHONPATH=DS_SITE, TORCH_EXTENSIONS_DIR="/tmp/torch_ext")
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(["nice", "-n", "10", ctx.python, "-c", DS_BUILD],
                                         stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                         start_new_session=True)  # fmt: skip

    def finish(self, out: Path) -> dict[str, Any]:
        """Stop it if still running; its entry for the summary (its log appended to bench.log)."""
        if self.proc is None:
            return runner.entry("deepspeed_build", "skipped", 0.0, "bench.log",
                                note="no CUDA or no DeepSpeed in " + DS_SITE)  # fmt: skip
        rc = self.proc.poll()
        if rc is None:
            runner.stop(self.proc)
        status = {None: "timed out", 0: "passed"}.get(rc, "failed")
        with open(out / "bench.log", "a") as f:
            f.write("\n==== deepspeed_build (background)\n" + self.log.read_text(errors="replace"))
        return runner.entry("deepspeed_build", status, time.monotonic() - self.t0, "bench.log",
                            note="DeepSpeed's CPU Adam, built during the GPU tests")  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="folder for summary.json, the logs and data.tgz")
    p.add_argument("--rehearsal", action="store_true", help="the CPU rehearsal even with CUDA")
    p.add_argument("--cap", type=float, default=None, help="seconds for the whole check "
                   "(default 480 on a GPU, 300 for the rehearsal)")  # fmt: skip
    p.add_argument("--steps", nargs="+", choices=[s.name for s in STEPS], default=None,
                   help="only these steps (default all)")  # fmt: skip
    p.add_argument("--python", default=os.environ.get("PYTHON", "python3"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    ctx = make_ctx(args, scratch)
    cap = args.cap or (480.0 if ctx.cuda else 300.0)
    meta = {"mode": "gpu" if ctx.cuda else "cpu rehearsal", "cap_s": cap, "python": ctx.python,
            "pytest_timeout": ctx.timeout_plugin, "xdist": ctx.xdist}  # fmt: skip
    chosen = [s for s in STEPS if args.steps is None or s.name in args.steps]
    done: list[dict[str, Any]] = []
    ds = None
    try:
        for step in chosen:
            if step.name == "throughput" and ds is not None:
                done.append(ds.finish(out))
                ctx.ds_ready = done[-1]["status"] == "passed"
            left = cap - (time.monotonic() - t0)
            done.append(run_step(step, ctx, out, left))
            print(f"== {step.name}: {done[-1]['status']} ({done[-1]['seconds']:.0f} s)", flush=True)
            wanted = any(s.name == "throughput" for s in chosen)
            if step.name == "install" and done[-1]["status"] == "passed" and wanted:
                ds = DeepSpeedBuild(ctx)
            pack(ctx, out, chosen)
            write_summary(out, {**meta, "seconds": round(time.monotonic() - t0, 1)}, done)
    finally:
        if ds is not None and ds.proc is not None and ds.proc.poll() is None:
            runner.stop(ds.proc)
        shutil.rmtree(scratch, ignore_errors=True)
    print(table(done, time.monotonic() - t0))
    # DeepSpeed's own build decides only whether the throughput row has a DeepSpeed column.
    ours = [s for s in done if s["name"] != "deepspeed_build"]
    return 0 if all(s["status"] in ("passed", "skipped") for s in ours) else 1


if __name__ == "__main__":
    sys.exit(main())
