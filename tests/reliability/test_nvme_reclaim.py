"""Issue 31, item 3: swap folders of dead runs are reclaimed. A run SIGKILLed mid-training
leaves ``zero_offload_swap/<host>-pid<pid>-<rand>/`` behind; the next run on the same
``nvme_path`` removes it at start with one log line, keeps the folders of live runs and of
other hosts, and a free-space error names the folders it kept."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from test_nvme_offload import _engine

from zero_offload.config.errors import ConfigError

KILLED_RUN = """
import sys
sys.path[:0] = sys.argv[2:]
from pathlib import Path
from test_nvme_offload import _engine, _train
engine = _engine(Path(sys.argv[1]))
_train(engine, range(1))
print("trained", flush=True)
sys.stdin.read()  # killed here
"""


def _killed_run(path: Path) -> Path:
    """The swap folder a SIGKILLed run left under ``path``."""
    tests = [str(Path(__file__).parent), str(Path(__file__).parent.parent)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*sys.path, *tests]))
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_RUN, str(path), *tests],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout.readline().strip() == "trained"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    (left,) = (path / "zero_offload_swap").iterdir()
    assert any(left.rglob("*.swp")) and f"-pid{proc.pid}-" in left.name
    return left


def _kept_folders(path: Path) -> list[Path]:
    root = path / "zero_offload_swap"
    other_host = root / "some-other-host-pid1-0123456789ab"
    live = root / f"{socket.gethostname()}-pid{os.getpid()}-0123456789ab"  # this process
    for folder in (other_host, live):
        (folder / "rank00000" / "optimizer").mkdir(parents=True)
        (folder / "rank00000" / "optimizer" / "group0.swp").write_bytes(b"\0" * 8192)
    return [other_host, live]


def test_a_killed_runs_folder_is_reclaimed_at_the_next_start(tmp_path, caplog):
    swap = tmp_path / "swap"
    dead = _killed_run(swap)
    kept = _kept_folders(swap)
    with caplog.at_level(logging.WARNING, logger="zero_offload"):
        engine = _engine(swap)
    assert not dead.exists()
    assert all(k.exists() for k in kept)
    lines = [r.getMessage() for r in caplog.records if "reclaimed" in r.getMessage()]
    assert len(lines) == 1 and "removed 1 swap folder(s)" in lines[0], lines
    engine.destroy()


def test_the_free_space_error_names_the_folders_it_kept(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    swap = tmp_path / "swap"
    kept = _kept_folders(swap)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1 << 30, 1 << 30, 0))
    with pytest.raises(ConfigError, match="has 0.00 GiB free") as err:
        _engine(swap)
    for folder in kept:
        assert str(folder) in str(err.value), err.value
    assert "of host some-other-host" in str(err.value)
    assert f"process {os.getpid()} is running" in str(err.value)
