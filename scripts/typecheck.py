"""mypy over src/ against a checked-in baseline of the errors allowed today
(``scripts/typecheck_baseline.txt``): a new error fails (CI runs this), a fixed one is reported
so the baseline can shrink (``--update`` rewrites it). Errors are counted per file and error
code (``[attr-defined]``...): edits that move lines, and mypy's own rewording of a type between
a cached and a fresh run, do not count as new errors; one more error of a code in a file does.

    python scripts/typecheck.py [--update]
"""

from __future__ import annotations

import collections
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINE = ROOT / "scripts" / "typecheck_baseline.txt"
LINE = re.compile(r"^(?P<file>[^:]+):\d+: error: .*\[(?P<code>[a-z-]+)\]$")


def errors() -> collections.Counter:
    """Each error as ``file [code]``, counted."""
    cmd = [sys.executable, "-m", "mypy", "src/zero_offload", "--no-pretty", "--no-error-summary"]
    cmd += ["--show-error-codes"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if out.returncode not in (0, 1):
        sys.exit(f"mypy did not run:\n{out.stdout}{out.stderr}")
    found = collections.Counter()
    for line in out.stdout.splitlines():
        m = LINE.match(line)
        if m:
            found[f"{m['file']} [{m['code']}]"] += 1
    return found


def main() -> int:
    found = errors()
    if "--update" in sys.argv:
        BASELINE.write_text("".join(f"{e}\n" for e in sorted(found.elements())))
        print(f"baseline: {sum(found.values())} errors")
        return 0
    allowed = collections.Counter(BASELINE.read_text().splitlines())
    new, fixed = found - allowed, allowed - found
    for e in sorted(new.elements()):
        print(f"new type error: {e}")
    if fixed:
        print(f"{sum(fixed.values())} baseline error(s) fixed: run scripts/typecheck.py --update")
    print(
        f"mypy: {sum(found.values())} errors, baseline {sum(allowed.values())}, new {sum(new.values())}"
    )
    return 1 if new else 0


if __name__ == "__main__":
    sys.exit(main())
