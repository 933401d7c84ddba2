"""``zero-offload config-docs``: the config reference (``docs/config.md``), generated from the
config's field declarations. ``--out FILE`` writes it, ``--check FILE`` exits 1 when the file is
not what would be written (a stale page), and with neither it is printed."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group()
    where.add_argument("--out", metavar="FILE", help="write the reference to FILE")
    where.add_argument(
        "--check", metavar="FILE", help="exit 1 if FILE differs from the generated reference"
    )


def run(args: argparse.Namespace) -> int:
    from zero_offload.config.reference import render

    text = render()
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
        return 0
    if args.check:
        path = Path(args.check)
        current = path.read_text(encoding="utf-8") if path.is_file() else None
        if current != text:
            why = "is missing" if current is None else "is stale (the config's fields changed)"
            print(
                f"config-docs: {path} {why}; regenerate it: zero-offload config-docs --out {path}",
                file=sys.stderr,
            )
            return 1
        return 0
    sys.stdout.write(text)
    return 0
