"""Print the disk's busy and idle time per phase of each training step from a timeline written
under ZERO_OFFLOAD_NVME_TRACE (``zero_offload/nvme/io/trace.py``):

    ZERO_OFFLOAD_NVME_TRACE=/tmp/io.jsonl python train.py ...
    python benchmarks/nvme_trace.py /tmp/io.jsonl
"""

from __future__ import annotations

import argparse
from pathlib import Path

from zero_offload.nvme.io.trace_report import load, phases, table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("trace", type=Path)
    print(table(phases(load(ap.parse_args().trace))))


if __name__ == "__main__":
    main()
