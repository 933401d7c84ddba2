"""One step of the GPU check (``scripts/gpu_check.py``): a command in its own process group with
a time limit, its output appended to the step's log as it comes, and its result as one summary
entry. A step over its limit gets SIGINT first (pytest then still prints which tests failed), then
SIGKILL for the whole group (workers holding GPU memory included)."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GRACE_S = 10.0  # after SIGINT, before SIGKILL
PYTEST_LINE = re.compile(r"^=*\s*(\d+(?:/\d+)? (passed|failed|skipped|errors?|deselected|xfailed|"
                         r"xpassed|warnings?|tests? collected)\b.*) in [\d.]+s", re.M)  # fmt: skip


@dataclass
class Outcome:
    """What a command did: exit code (None: stopped at its limit), seconds, its output's tail."""

    rc: int | None
    seconds: float
    tail: str
    notes: list[str] = field(default_factory=list)


def run(cmd: list[str], log: Path, timeout: float, env: dict[str, str], cwd: Path) -> Outcome:
    """Run ``cmd`` appending its output to ``log``; stop it at ``timeout`` seconds."""
    t0 = time.monotonic()
    with open(log, "a") as f:
        f.write(f"$ {shlex.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd, env=env,
                                start_new_session=True)  # fmt: skip
        try:
            rc: int | None = proc.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            rc = None
            stop(proc)
        except BaseException:
            stop(proc)
            raise
    return Outcome(rc, time.monotonic() - t0, _tail(log))


def stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGINT, GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            if sig == signal.SIGINT:  # its workers may outlive it: end the group anyway
                os.killpg(proc.pid, signal.SIGKILL)
            return
        except (subprocess.TimeoutExpired, ProcessLookupError):
            continue


def _tail(log: Path, nbytes: int = 20000) -> str:
    with open(log, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - nbytes))
        return f.read().decode(errors="replace")


def pytest_result(tail: str) -> str | None:
    """pytest's last summary line ("3 passed, 1 skipped in 2.10s"), if it printed one."""
    found = PYTEST_LINE.findall(tail)
    return found[-1][0] if found else None


def status_of(out: Outcome, skipped_ok: bool = True) -> str:
    """passed / failed / skipped / timed out. pytest's exit 5 (nothing collected) is skipped; a
    pytest run that skipped tests fails where ``skipped_ok`` is False (the GPU's own tests)."""
    if out.rc is None:
        return "timed out"
    if out.rc == 5:
        return "skipped"
    if out.rc != 0:
        return "failed"
    line = pytest_result(out.tail) or ""
    if not skipped_ok and " skipped" in line:
        out.notes.append("tests skipped on a GPU machine")
        return "failed"
    return "passed"


def entry(name: str, status: str, seconds: float, details: str, **extra: Any) -> dict[str, Any]:
    """One step of ``summary.json``."""
    return {"name": name, "status": status, "seconds": round(seconds, 1), "details": details,
            **{k: v for k, v in extra.items() if v not in (None, [], "")}}  # fmt: skip
