"""Issue 59: ranks (and jobs) that start on one ``nvme_path`` at the same moment. Each rank's
start-up check creates the path when it is missing and reclaims the swap folders of dead runs
there (``nvme/preflight.py``, ``nvme/reclaim.py``); done by several processes at once, neither
may fail because of the others' work: a folder that vanished was reclaimed by another, a
directory another made is a directory. The processes here call the check itself, hundreds of
rounds, released together by a barrier; nothing is trained."""

from __future__ import annotations

import socket
import uuid
from pathlib import Path

import pytest
import torch
from distributed import _start_context, every_rank

from zero_offload.config.errors import ConfigError
from zero_offload.nvme.io.aio import SwapFile
from zero_offload.nvme.io.file_guard import check_swap_file, hold
from zero_offload.nvme.io.scratch import discard
from zero_offload.nvme.path_agreement import PathNeed, check_nvme_paths
from zero_offload.nvme.preflight import check_nvme_path
from zero_offload.nvme.reclaim import SWAP_ROOT
from zero_offload.nvme.swap_root import making
from zero_offload.runtime.update.placement import run_name

KEY = "zero_optimization.offload_optimizer.nvme_path"
PARAM_KEY = "zero_optimization.offload_param.nvme_path"
ROUNDS = 200
DEAD_PID = 4_194_400  # above the kernel's largest pid_max (2**22): never a live process


def _dead_run(root: Path, n: int, ranks: int = 2) -> Path:
    """A killed run's folder: every rank's optimizer and param files, none held."""
    folder = root / SWAP_ROOT / f"{socket.gethostname()}-pid{DEAD_PID + n}-{n:012x}"
    for r in range(ranks):
        for kind in ("optimizer", "param"):
            sub = folder / f"rank{r:05d}" / kind
            sub.mkdir(parents=True)
            for g in range(2):
                (sub / f"group{g}.swp").write_bytes(b"\0" * 4096)
    return folder


def _rounds(base: Path, rounds: int) -> list[tuple[Path, list[Path]]]:
    """(nvme_path, the dead folders under it) per round: even rounds start on a path that does
    not exist yet (the creation race), odd ones on a path holding two killed runs' folders
    (the reclaim race)."""
    out = []
    for i in range(rounds):
        path = base / f"round{i:04d}" / "swap"
        dead = [] if i % 2 == 0 else [_dead_run(path, 2 * i), _dead_run(path, 2 * i + 1)]
        out.append((path, dead))
    return out


def _checker(paths: list[str], barrier, queue) -> None:
    """One rank's start-ups: every round, wait for the others, then check the round's path."""
    failures = []
    for i, path in enumerate(paths):
        barrier.wait(timeout=120)
        try:
            check_nvme_path(KEY, path, 0)
        except Exception as e:  # every failure is the finding: collect, keep racing
            failures.append(f"round {i}: {type(e).__name__}: {e}")
    queue.put(failures)


def _race(target, procs: int, *args) -> list[str]:
    """Run ``target(*args, barrier, queue)`` in ``procs`` processes; every failure they report."""
    ctx = _start_context()
    barrier, queue = ctx.Barrier(procs), ctx.SimpleQueue()
    workers = [ctx.Process(target=target, args=(*args, barrier, queue)) for _ in range(procs)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(300)
    assert all(w.exitcode == 0 for w in workers), [w.exitcode for w in workers]
    return [f for _ in workers for f in queue.get()]


@pytest.mark.parametrize("ranks", [2, 4])
def test_ranks_check_and_reclaim_one_path_at_once(tmp_path, ranks):
    rounds = _rounds(tmp_path, ROUNDS)
    failures = _race(_checker, ranks, [str(p) for p, _ in rounds])
    assert not failures, f"{len(failures)} failed start-ups, first: {failures[:3]}"
    for path, dead in rounds:
        assert path.is_dir() and not any(d.exists() for d in dead), path


def test_a_path_another_rank_makes_meanwhile_is_a_directory(tmp_path, monkeypatch):
    """The creation race, made certain: the folder appears just after this rank saw it
    missing (another rank's ``mkdir`` in between)."""
    path = tmp_path / "new" / "swap"
    real_is_dir = Path.is_dir
    looks = []

    def is_dir(self: Path) -> bool:
        got = real_is_dir(self)
        if self == path and not looks:  # the first look: missing; then the other rank makes it
            looks.append(got)
            path.mkdir(parents=True)
        return got

    monkeypatch.setattr(Path, "is_dir", is_dir)
    assert check_nvme_path(KEY, path, 0) == path.resolve()
    assert looks == [False]


def test_a_file_where_the_path_goes_is_still_not_a_directory(tmp_path):
    path = tmp_path / "swap"
    path.write_text("x")
    with pytest.raises(ConfigError, match="is not a directory"):
        check_nvme_path(KEY, path, 0)
    with pytest.raises(ConfigError, match="is not a directory"):
        check_nvme_path(KEY, path, 0, prepare=False)


def test_a_rank_that_does_not_prepare_neither_creates_nor_reclaims(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    missing = tmp_path / "missing"
    with pytest.raises(ConfigError, match="does not exist"):
        check_nvme_path(KEY, missing, 0, prepare=False)
    assert not missing.exists()
    dead = _dead_run(tmp_path, 0)
    assert check_nvme_path(KEY, tmp_path, 0, prepare=False) == tmp_path.resolve()
    assert dead.is_dir()  # the preparing rank's to reclaim
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1 << 30, 1 << 30, 0))
    with pytest.raises(ConfigError, match="0.00 GiB free") as err:
        check_nvme_path(KEY, tmp_path, 1, prepare=False)
    assert f"{dead} (0.00 GiB, its run has ended, not removed)" in str(err.value)


def _agreed_start_ups(paths: list[str]) -> list[list[str]]:
    """One rank's start-ups through the agreement, the optimizer and the params on one path;
    the paths it prepared, per round."""
    cpu = torch.device("cpu")
    both = [[PathNeed(KEY, Path(p), 0), PathNeed(PARAM_KEY, Path(p), 0)] for p in paths]
    return [[str(p) for p in check_nvme_paths(needs, cpu)] for needs in both]


@pytest.mark.parametrize("ranks", [2, 4])
def test_one_rank_per_node_prepares_each_path_at_the_agreement(tmp_path, ranks):
    rounds = _rounds(tmp_path, ROUNDS // 2)
    prepared = every_rank(ranks, _agreed_start_ups, [str(p) for p, _ in rounds])
    for i, (path, dead) in enumerate(rounds):  # one host, one folder: the lowest rank
        want = [[str(path)] * 2] + [[]] * (ranks - 1)
        assert [prepared[r][i] for r in range(ranks)] == want
        assert path.is_dir() and not any(d.exists() for d in dead), path


def _job_rank(job: int, rank: int, paths: list[str], barrier, queue) -> None:
    """Rank ``rank`` of job ``job``, two jobs sharing the drive. Job 1 runs as if in another pid
    namespace: its folders carry a pid not alive here, so only its held swap files (and the
    swap root's lock while it makes them) keep the other job's reclaim away."""
    host = socket.gethostname()
    run = run_name() if job == 0 else f"{host}-pid{DEAD_PID - 1 - rank}-{uuid.uuid4().hex[:12]}"
    failures = []
    for i, path in enumerate(paths):
        barrier.wait(timeout=120)
        try:
            check_nvme_path(KEY, path, 0)  # this job starts while the other does
            folder = Path(path) / SWAP_ROOT / run / f"rank{rank:05d}" / "optimizer"
            with making(folder):  # as NvmeOptimizerState makes its files
                file = SwapFile.create(folder / "group0.swp", 4096, direct=False)
                hold(file)
        except Exception as e:
            failures.append(f"round {i}, job {job} rank {rank}: {type(e).__name__}: {e}")
            file = None
        barrier.wait(timeout=120)  # both jobs live
        try:
            check_nvme_path(KEY, path, 0)  # one more start on the drive, both jobs live
            if file is not None:
                check_swap_file(file, "optimizer")  # still the file this rank made
        except Exception as e:
            failures.append(f"round {i}, job {job} rank {rank}, live: {type(e).__name__}: {e}")
        barrier.wait(timeout=120)
        if file is not None:
            discard(file)
    queue.put([run, *failures])


def test_two_jobs_on_one_drive_keep_apart_and_keep_each_others_live_folders(tmp_path):
    rounds = _rounds(tmp_path, ROUNDS // 2)
    ctx = _start_context()
    barrier, queue = ctx.Barrier(4), ctx.SimpleQueue()
    args = [str(p) for p, _ in rounds]
    workers = [
        ctx.Process(target=_job_rank, args=(job, rank, args, barrier, queue))
        for job in (0, 1)
        for rank in (0, 1)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join(300)
    assert all(w.exitcode == 0 for w in workers), [w.exitcode for w in workers]
    got = [queue.get() for _ in workers]
    runs, failures = [g[0] for g in got], [f for g in got for f in g[1:]]
    assert not failures, f"{len(failures)} failures, first: {failures[:3]}"
    assert len(set(runs)) == 4  # each rank of each job its own folder
    for path, dead in rounds:  # the dead runs reclaimed, every live folder gone with its run
        assert path.is_dir() and not any(d.exists() for d in dead), path
        assert not any((path / SWAP_ROOT).glob("*/rank*/optimizer/*.swp")), path
