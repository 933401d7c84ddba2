"""Crash safety: a process killed with SIGKILL at any point of a save leaves the previous checkpoint
whole, loadable and named by ``latest``; the next save in the same directory succeeds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import CRASH_CASE, build, snapshot, train

import zero_offload
from zero_offload.checkpoint import atomic

HERE = Path(__file__).resolve().parent
SRC = Path(zero_offload.__file__).resolve().parents[1]

# (pause point, tag of the second save): the second save is killed at the pause point.
POINTS = [
    ("after_shards", None),  # shard files written, no meta.json yet, nothing renamed
    ("before_latest", None),  # new tag published, ``latest`` not yet updated
    ("replaced", "global_step2"),  # re-saving an existing tag: the old copy is set aside
]


def _spawn(root: Path, point: str, tag: str | None) -> tuple[subprocess.Popen, Path]:
    log = root.parent / f"{root.name}.stderr"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(SRC), str(HERE)]),
        ZERO_OFFLOAD_CHECKPOINT_PAUSE=point,
    )
    args = [sys.executable, str(HERE / "checkpoint_helpers.py"), "crash", str(root)] + (
        [tag] if tag else []
    )
    with open(log, "wb") as err:
        proc = subprocess.Popen(args, cwd=HERE, env=env, stdout=subprocess.DEVNULL, stderr=err)
    return proc, log


def _kill_when_paused(proc: subprocess.Popen, log: Path, point: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    marker = f"checkpoint paused at {point}"
    while marker not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(
                f"child never paused at {point}:\n{log.read_text(errors='replace')[-3000:]}"
            )
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    base = tmp_path_factory.mktemp("crash")
    children = []
    for point, tag in POINTS:  # all children run at once; each is killed at its own point
        root = base / point
        children.append((point, root, *_spawn(root, point, tag)))
    for point, _, proc, log in children:
        _kill_when_paused(proc, log, point)
    return {point: root for point, root, _, _ in children}


@pytest.fixture(scope="module")
def step2_reference():
    engine, model = build(CRASH_CASE)
    train(engine, CRASH_CASE, 0, 2)
    ref = snapshot(engine, model)
    engine.destroy()
    return ref


def _load_latest(root: Path) -> dict:
    engine, model = build(CRASH_CASE)
    path, _ = engine.load_checkpoint(str(root))
    assert path is not None
    out = snapshot(engine, model)
    engine.destroy()
    return out


@pytest.mark.parametrize("point", [p for p, _ in POINTS])
def test_killed_save_leaves_previous_checkpoint(crashed, step2_reference, point):
    root = crashed[point]
    assert (root / "latest").read_text() == "global_step2"
    got = _load_latest(root)
    assert got["counters"] == step2_reference["counters"]
    for k, v in step2_reference["master"].items():
        assert torch.equal(got["master"][k], v), k
    if point == "before_latest":  # the new checkpoint is whole too, just not named by latest yet
        assert (root / "global_step3" / "meta.json").is_file()
    if point == "replaced":  # the tag itself is mid-swap; the set-aside copy is what loads
        assert (
            not (root / "global_step2").exists()
            and atomic.replaced_dir(root, "global_step2").is_dir()
        )


def test_next_save_after_crash_succeeds(crashed, step2_reference):
    for point in ("after_shards", "replaced"):
        root = crashed[point]
        engine, model = build(CRASH_CASE)
        engine.load_checkpoint(str(root))
        train(engine, CRASH_CASE, 2, 3)
        engine.save_checkpoint(str(root), tag="global_step2" if point == "replaced" else None)
        engine.destroy()
        names = sorted(p.name for p in root.iterdir())
        assert not [n for n in names if n.startswith(".") and n != ".latest.tmp"], names
        assert (root / "latest").read_text() == (
            "global_step2" if point == "replaced" else "global_step3"
        )
        assert _load_latest(root)["counters"][0] == 3


def test_write_latest_is_atomic(tmp_path):
    atomic.write_latest(tmp_path, "a")
    atomic.write_latest(tmp_path, "b")
    assert atomic.read_latest(tmp_path) == "b"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]
