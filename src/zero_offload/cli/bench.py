"""``zero-offload bench``: benchmark the host update path (this kernel, the PyTorch fused AdamW
path, DeepSpeedCPUAdam when available) against the memory-bandwidth bound. Same measurement as
``benchmarks/host_update.py``; the implementation lives in zero_offload.kernels.bench."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from zero_offload.kernels.bench import add_arguments as _add  # argparse-level code only

    _add(parser)


def run(args: argparse.Namespace) -> int:
    from zero_offload.kernels.bench import run as _run

    return _run(args)
