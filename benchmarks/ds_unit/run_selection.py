"""Run DeepSpeed's own unit tests (a selection of its ``tests/unit``) against zero_offload.

Usage (from a DeepSpeed checkout's ``tests`` directory, or any copy of it)::

    ZERO_OFFLOAD_AS_DEEPSPEED=1 python path/to/benchmarks/ds_unit/run_selection.py \\
        --tests-dir <deepspeed>/tests --out results/ unit/v1/zero unit/runtime/zero unit/checkpoint

Each test file runs in its own pytest process, one after the other (never in parallel), with
:mod:`plugin` loaded (CPU ranks on gloo, world size capped at 2), a time limit per file, and a
JUnit XML report per file under ``--out``. It prints per file and total passed / failed /
errors / skipped. Nothing here is part of the project's test suite.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _files(tests_dir: Path, selection: list[str]) -> list[Path]:
    out: list[Path] = []
    for item in selection:
        path = tests_dir / item
        out.extend(sorted(path.glob("test_*.py")) if path.is_dir() else [path])
    return out


def _counts(report: Path) -> dict[str, int]:
    if not report.exists():
        return {"passed": 0, "failed": 0, "errors": 1, "skipped": 0}
    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    total, failed = int(suite.get("tests", 0)), int(suite.get("failures", 0))
    errors, skipped = int(suite.get("errors", 0)), int(suite.get("skipped", 0))
    return {
        "passed": total - failed - errors - skipped,
        "failed": failed,
        "errors": errors,
        "skipped": skipped,
    }


def _message(node: ET.Element) -> str:
    """The failure's first line; for a collection error, the exception line of its text."""
    lines = (node.get("message") or "").splitlines()
    if not lines or lines[0] == "collection failure":
        lines = [ln[1:].strip() for ln in (node.text or "").splitlines() if ln.startswith("E ")][
            -1:
        ] or lines
    return lines[0][:300] if lines else ""


def _rows(report: Path) -> list[str]:
    """One ``id<TAB>outcome<TAB>message`` line per test case of a JUnit report."""
    if not report.exists():
        return [f"{report.stem}\terror\tno report (timed out or crashed)"]
    rows = []
    for case in ET.parse(report).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome, message = tag, _message(node)
        rows.append(f"{test_id}\t{outcome}\t{message}")
    return rows


def _run_file(tests_dir: Path, test_file: Path, out: Path, timeout_s: int) -> dict[str, int]:
    report = out / (test_file.relative_to(tests_dir).as_posix().replace("/", "__") + ".xml")
    env = dict(os.environ, ZERO_OFFLOAD_AS_DEEPSPEED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH", "")) if p)
    env.setdefault("DS_UNITTEST_TIMEOUT", "180")
    env["DS_UNIT_STAND_INS"] = "1"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "plugin",
        "-q",
        "-rA",
        "--tb=line",
        f"--junitxml={report}",
    ]
    log = report.with_suffix(".log")
    with log.open("w") as sink:
        try:
            subprocess.run(
                cmd + [str(test_file)],
                cwd=tests_dir,
                env=env,
                stdout=sink,
                stderr=sink,
                timeout=timeout_s,
            )
        except subprocess.TimeoutExpired:
            sink.write(f"\nTIMEOUT after {timeout_s}s\n")
    return _counts(report)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--tests-dir", type=Path, required=True, help="DeepSpeed's tests/ directory"
    )
    parser.add_argument(
        "--out", type=Path, required=True, help="where the JUnit reports and logs go"
    )
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per test file")
    parser.add_argument("selection", nargs="+", help="directories or files under --tests-dir")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    total = dict.fromkeys(("passed", "failed", "errors", "skipped"), 0)
    for test_file in _files(args.tests_dir, args.selection):
        counts = _run_file(args.tests_dir, test_file, args.out, args.timeout)
        report = args.out / (
            test_file.relative_to(args.tests_dir).as_posix().replace("/", "__") + ".xml"
        )
        with (args.out / "results.tsv").open("a") as table:
            table.write("".join(row + "\n" for row in _rows(report)))
        total = {k: total[k] + counts[k] for k in total}
        print(test_file.relative_to(args.tests_dir), counts, flush=True)
    print("total", total)


if __name__ == "__main__":
    main()
