"""Issue 31, item 6: the streamed export's publish keeps the previous export until the new
one is complete. The writer is killed (SIGKILL) at its last pause point, after every new file
was written; the folder must still hold the previous export, byte for byte, and the user's own
files; the next export must succeed and leave no staging folder behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from zero_offload.checkpoint.export.sharded import ShardWriter, Spec, write_stream

SPECS = [Spec(f"t{i}", torch.float32, (1000,)) for i in range(6)]
WRITER = """
import sys, torch
from zero_offload.checkpoint.export.sharded import ShardWriter, Spec, write_stream
specs = [Spec(f"t{i}", torch.float32, (1000,)) for i in range(6)]
write_stream(ShardWriter(sys.argv[1], specs, 8000), ((s.name, torch.full((1000,), 2.0)) for s in specs))
"""


def _export(out: Path, value: float, max_size: int | None) -> None:
    tensors = ((s.name, torch.full((1000,), value)) for s in SPECS)
    write_stream(ShardWriter(out, SPECS, max_size), tensors)


def _killed_at(point: str, out: Path) -> None:
    env = dict(os.environ, ZERO_OFFLOAD_CHECKPOINT_PAUSE=point)
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(out)], env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline, line = time.monotonic() + 60, ""
        while f"paused at {point}" not in line and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "the export ended without pausing"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_a_kill_before_the_swap_keeps_the_previous_export(tmp_path):
    out = tmp_path / "out"
    _export(out, 1.0, None)  # the previous export: one model.safetensors
    (out / "tokenizer.json").write_text("{}")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    _killed_at("export_before_swap", out)  # the new one: three shards and an index
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert torch.equal(load_file(str(out / "model.safetensors"))["t0"], torch.ones(1000))
    _export(out, 3.0, 8000)  # the next export clears what the killed one left
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging folder left


def test_a_folder_with_subfolders_is_published_in_place(tmp_path):
    """A Trainer's output folder (checkpoints, logs that other code may be writing): the export
    moves its files in, the index last, and never moves or copies the folder's subfolders."""
    out = tmp_path / "out"
    (out / "checkpoint-10").mkdir(parents=True)
    (out / "checkpoint-10" / "state.bin").write_bytes(b"x" * 10)
    inode = (out / "checkpoint-10").stat().st_ino
    _export(out, 1.0, 8000)
    _export(out, 2.0, None)
    assert (out / "checkpoint-10").stat().st_ino == inode
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-10", "model.safetensors"]
    assert torch.equal(load_file(str(out / "model.safetensors"))["t5"], torch.full((1000,), 2.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
