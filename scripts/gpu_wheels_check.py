"""Checks ``.whl/`` (scripts/gpu_wheels.sh) before a lease: every wheel the GPU check's install
needs is there, one version of each (two stop the install there), the carried typing_extensions
is as new as the carried pydantic asks, and the wheels with the checkout's tracked files fit in
what a lease carries (64 MiB). Prints one line per finding; exits 1 on any.

    python scripts/gpu_wheels_check.py [.whl]
"""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CARRY_LIMIT = 64 << 20  # the working tree and the carried paths of one call, together
# What scripts/gpu_install.sh installs from .whl/ (the machine has none of these, or too old).
NEEDED = ("setuptools", "wheel", "pydantic", "pydantic_core", "annotated_types",
          "typing_inspection", "typing_extensions")  # fmt: skip


def _name(wheel: Path) -> str:
    return wheel.name.split("-")[0].lower().replace(".", "_")


def _version(wheel: Path) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", wheel.name.split("-")[1])[:3])


def _requires(wheel: Path, dist: str) -> tuple[int, ...] | None:
    """The lower bound ``wheel``'s METADATA puts on ``dist`` (``Requires-Dist: dist>=x.y.z``)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    pat = re.escape(dist).replace(r"_", "[-_]")
    m = re.search(rf"^Requires-Dist: {pat}\s*>=\s*([\d.]+)", text, re.M | re.I)
    return tuple(int(x) for x in m.group(1).split(".")) if m else None


def tracked_bytes() -> int:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True)
    paths = [REPO / p for p in files.stdout.decode().split("\0") if p]
    return sum(p.stat().st_size for p in paths if p.is_file())


def problems(folder: Path) -> list[str]:
    wheels = sorted(folder.glob("*.whl"))
    by_name: dict[str, list[Path]] = {}
    for w in wheels:
        by_name.setdefault(_name(w), []).append(w)
    found = [f"{n}: none in {folder}" for n in NEEDED if n not in by_name]
    found += [f"{n}: {len(ws)} versions ({', '.join(w.name for w in ws)}); keep one"
              for n, ws in by_name.items() if len(ws) > 1]  # fmt: skip
    if "pydantic" in by_name and "typing_extensions" in by_name:
        need = _requires(by_name["pydantic"][0], "typing_extensions")
        have = _version(by_name["typing_extensions"][0])
        if need and have < need:
            found.append(f"typing_extensions {have} is older than pydantic's >= {need}")
    carried = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    total = carried + tracked_bytes()
    if total > CARRY_LIMIT:
        found.append(
            f"{folder} ({carried / 2**20:.1f} MiB) with the checkout's tracked files: "
            f"{total / 2**20:.1f} MiB, over the {CARRY_LIMIT >> 20} MiB a call carries"
        )
    print(f"wheels: {len(wheels)} in {folder}, {carried / 2**20:.1f} MiB; with the tracked "
          f"files {total / 2**20:.1f} MiB of {CARRY_LIMIT >> 20}")  # fmt: skip
    return found


def main(argv: list[str]) -> int:
    folder = Path(argv[0]) if argv else REPO / ".whl"
    found = problems(folder)
    for p in found:
        print("wheels: " + p)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
