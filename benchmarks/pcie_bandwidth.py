"""The host<->GPU link's measured bandwidth: the ceiling for the engine's grad and param copies.

Copies of one buffer per size (powers of two from ``--min`` to ``--max``), host to device and
device to host, from pinned and from pageable host memory, and both directions at once on two
streams (pinned); each timed with CUDA events on its stream, after warm-up copies, median of
``--repeats``. Prints a Markdown table in GB/s (10^9 bytes/s) and, with ``--json``, writes every
repeat.

    python benchmarks/pcie_bandwidth.py                      # 1 MiB .. 1 GiB
    python benchmarks/pcie_bandwidth.py --max 256MiB --json pcie.json

Without CUDA it says so, writes ``{"skipped": ...}`` to ``--json`` if given, and exits 0.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bandwidth import KINDS, format_size, measure, parse_size, size_range, summarize, table  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--min", type=parse_size, default=parse_size("1MiB"), help="default 1MiB")
    p.add_argument("--max", type=parse_size, default=parse_size("1GiB"), help="default 1GiB")
    p.add_argument("--repeats", type=int, default=10, help="timed copies per point (median)")
    p.add_argument("--warmup", type=int, default=2, help="untimed copies per point first")
    p.add_argument(
        "--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="transfers to measure"
    )
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        p.error("--repeats must be >= 1 and --warmup >= 0")
    try:
        args.sizes = size_range(args.min, args.max)
    except ValueError as e:
        p.error(str(e))
    return args


class Buffers:
    """One device buffer each way, and pinned and pageable host buffers (a source of ones, a
    destination of zeros), of the largest size; every copy uses a leading slice of them. Pinned
    only on CUDA (the tests build them on the CPU)."""

    def __init__(self, nbytes: int, kinds: list[str], device) -> None:
        import torch

        cuda = device.type == "cuda"
        self.dev_src = torch.ones(nbytes, dtype=torch.uint8, device=device)
        self.dev_dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.host = {}
        for memory in ("pinned", "pageable"):
            if any(k.endswith(memory) for k in kinds):  # filled: no page faults are timed
                pin = cuda and memory == "pinned"
                self.host[memory] = (
                    torch.ones(nbytes, dtype=torch.uint8, pin_memory=pin),
                    torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin),
                )


def copies_for(kind: str, size: int, buffers: Buffers, s1, s2) -> list[tuple[Any, Any]]:
    """(stream, copy function) pairs of one transfer of ``kind``: h2d host source -> device
    destination, d2h device source -> host destination, bidir both at once on two streams."""
    direction, memory = kind.split("_")
    h_src, h_dst = (t[:size] for t in buffers.host[memory])
    d_src, d_dst = buffers.dev_src[:size], buffers.dev_dst[:size]

    def h2d() -> None:
        d_dst.copy_(h_src, non_blocking=True)

    def d2h() -> None:
        h_dst.copy_(d_src, non_blocking=True)

    return {"h2d": [(s1, h2d)], "d2h": [(s1, d2h)], "bidir": [(s1, h2d), (s2, d2h)]}[direction]


# GPU cycles of the busy kernel queued before each start event (~0.5 ms): the start event and the
# copies are then all queued before the GPU reaches them, so no host launch latency is timed.
HOLD_CYCLES = 1_000_000


def _timed(streams_and_copies, warmup: int, repeats: int) -> list[float]:
    """Seconds per repeat of copies started together (one per stream) after one start event on
    the current stream; a repeat ends when the last copy ends."""
    import torch

    times = []
    main = torch.cuda.current_stream()
    for i in range(warmup + repeats):
        torch.cuda.synchronize()
        torch.cuda._sleep(HOLD_CYCLES)
        start = torch.cuda.Event(enable_timing=True)
        start.record(main)
        ends = []
        for stream, copy in streams_and_copies:
            stream.wait_event(start)
            with torch.cuda.stream(stream):
                copy()
                end = torch.cuda.Event(enable_timing=True)
                end.record(stream)
            ends.append(end)
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(max(start.elapsed_time(e) for e in ends) / 1e3)
    return times


def cuda_timer(buffers: Buffers, warmup: int, repeats: int) -> Callable[[str, int], list[float]]:
    """``time_fn(kind, size)`` for ``_bandwidth.measure``: seconds of each repeat on CUDA."""
    import torch

    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def time_fn(kind: str, size: int) -> list[float]:
        return _timed(copies_for(kind, size, buffers, s1, s2), warmup, repeats)

    return time_fn


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        why = "pcie_bandwidth.py needs CUDA (torch.cuda.is_available() is False): nothing measured"
        print(why)
        if args.json:
            args.json.write_text(json.dumps({"skipped": why}))
        return 0
    t0 = time.perf_counter()
    buffers = Buffers(
        max(args.sizes), args.kinds, torch.device("cuda", torch.cuda.current_device())
    )
    raw = measure(args.sizes, args.kinds, cuda_timer(buffers, args.warmup, args.repeats))
    summary = summarize(raw)
    meta: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "repeats": args.repeats,
        "warmup": args.warmup,
        "elapsed_s": time.perf_counter() - t0,
    }
    print(
        f"\n{meta['device']}, torch {meta['torch']} (CUDA {meta['cuda']}); sizes "
        f"{format_size(args.sizes[0])} .. {format_size(args.sizes[-1])}; median of "
        f"{args.repeats} after {args.warmup} warm-up; GB/s = 10^9 bytes/s\n"
    )
    print(table(summary))
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, **summary, "raw": raw}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
