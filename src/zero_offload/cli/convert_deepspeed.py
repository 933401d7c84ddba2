"""``zero-offload convert-deepspeed SRC DST``: a DeepSpeed checkpoint (stages 0-3) converted to
this project's format, so ``engine.load_checkpoint(DST)`` resumes where DeepSpeed stopped."""

from __future__ import annotations

import argparse
import time

from .errors import report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="DeepSpeed save_dir (with 'latest') or a global_stepN folder")
    parser.add_argument("dst", help="output save_dir (gets <tag>/ and 'latest')")
    parser.add_argument("--tag", help="DeepSpeed tag to convert (default: SRC/latest's)")


def run(args: argparse.Namespace) -> int:
    from ..checkpoint import CheckpointError
    from ..checkpoint.deepspeed import convert_deepspeed_checkpoint

    t0 = time.perf_counter()
    try:
        out = convert_deepspeed_checkpoint(args.src, args.dst, tag=args.tag)
    except (CheckpointError, OSError) as err:
        return report("convert-deepspeed", err)
    print(
        f"wrote {out} in {time.perf_counter() - t0:.2f}s; load it with engine.load_checkpoint({args.dst!r})"
    )
    return 0
