"""Every seed tutorial config trains, unchanged, through the Megatron-style example on two ranks
launched by ``zero-offload launch --num_gpus 2`` (CPU ranks on gloo), with a scaled-down model."""

from __future__ import annotations

import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONFIGS = [
    "ds_zero_stage_1.config",
    "ds_zero_stage_2.config",
    "ds_zero_offload.config",
    "ds_offload_fp16_adamw.json",
]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("name", CONFIGS)
def test_seed_config_trains_on_two_ranks(name, tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "zero_offload.cli.main",
        "launch",
        "--num_gpus",
        "2",
        "--master_port",
        str(_port()),
        str(REPO / "examples" / "pretrain_gpt2.py"),
        "--model-parallel-size",
        "1",
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--batch-size",
        "4",
        "--seq-length",
        "32",
        "--train-iters",
        "6",
        "--log-interval",
        "2",
        "--deepspeed",
        "--deepspeed_config",
        str(REPO / "configs" / name),
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=1200)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    losses = [float(x) for x in re.findall(r"loss[ =:]+([0-9.]+)", proc.stdout)]
    assert losses, out[-2000:]
    assert all(math.isfinite(v) and v < 10 for v in losses)
