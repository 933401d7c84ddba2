"""The ``deepspeed`` command under the opt-in (``deepspeed.launcher.runner.main``, ``python -m
deepspeed``): ``zero-offload launch`` with DeepSpeed's launcher flags. Hostfiles,
``--include/--exclude``, SLURM node lists, the per-node commands (ssh, srun), and real launches
whose ranks train: two ranks on this node, and two "nodes" on this machine (``localhost`` and
``127.0.0.1`` in a hostfile, ssh replaced by a local stand-in), against the same script run
without either library."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import pytest

from zero_offload.cli.launch.hosts import HostError, expand_nodelist, parse_hostfile, select_hosts
from zero_offload.cli.launch.multinode import NodeLaunch, read_env_file, slurm_command, ssh_commands

SCRIPT = Path(__file__).parent / "launcher" / "train_ds.py"
CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 2},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
}


# ---- hostfile, include/exclude, node lists ----------------------------------------------------
def test_hostfile_lines_comments_and_order(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("# the cluster\nworker-1 slots=4\n\n  worker-0   slots=2  \n")
    assert parse_hostfile(path) == OrderedDict([("worker-1", 4), ("worker-0", 2)])


@pytest.mark.parametrize(
    "text, says",
    [
        ("worker-0 slots=2\nworker-1 slot=2\n", "line 2: 'worker-1 slot=2' does not parse"),
        ("worker-0\n", "line 1: 'worker-0' does not parse"),
        ("a slots=1\na slots=2\n", "line 2: host 'a' is listed twice"),
        ("# nothing\n", "no 'HOST slots=N' line"),
    ],
)
def test_bad_hostfile_names_the_line(tmp_path, text, says):
    path = tmp_path / "hostfile"
    path.write_text(text)
    with pytest.raises(HostError, match=f"hostfile {path}") as err:
        parse_hostfile(path)
    assert says in str(err.value)


def test_include_exclude_num_nodes_num_gpus():
    pool = OrderedDict([("w0", 4), ("w1", 4), ("w2", 2)])
    assert select_hosts(pool, include="w1:0,2@w0") == OrderedDict(w0=[0, 1, 2, 3], w1=[0, 2])
    assert select_hosts(pool, exclude="w1:0@w2") == OrderedDict(w0=[0, 1, 2, 3], w1=[1, 2, 3])
    assert select_hosts(pool, num_nodes=2, num_gpus=1) == OrderedDict(w0=[0], w1=[0])
    for kwargs, says in [
        ({"include": "w9"}, "host 'w9' is not in the hostfile"),
        ({"include": "w2:5"}, "host 'w2' has no slot 5"),
        ({"include": "w0", "exclude": "w1"}, "cannot be used together"),
        ({"include": "w0", "num_gpus": 1}, "cannot be used with"),
        ({"num_nodes": 4}, "lists 3 host"),
        ({"exclude": "w0@w1@w2"}, "leaves no host"),
    ]:
        with pytest.raises(HostError, match=says):
            select_hosts(pool, **kwargs)


def test_slurm_node_lists():
    assert expand_nodelist("node[01-03,7],gpu5") == ["node01", "node02", "node03", "node7", "gpu5"]


# ---- per-node commands ------------------------------------------------------------------------
def _plan(hosts) -> NodeLaunch:
    return NodeLaunch(OrderedDict(hosts), "w0", 29501, "train.py", ("--deepspeed", "ds.json"))


def test_ssh_command_per_node(monkeypatch):
    monkeypatch.delenv("ZERO_OFFLOAD_SSH", raising=False)
    plan = _plan([("w0", [0, 1]), ("w1", [1, 3])])
    cmds = ssh_commands(plan, {"PYTHONPATH": "/job", "NCCL_DEBUG": "INFO"}, "/job", 2222)
    assert [c[:4] for c in cmds] == [["ssh", "-p", "2222", "w0"], ["ssh", "-p", "2222", "w1"]]
    first, second = cmds[0][4], cmds[1][4]
    assert first.startswith("cd /job; ") and "export NCCL_DEBUG=INFO" in first
    assert "--num_nodes=2 --num_gpus=2 --node_rank=0 --master_addr=w0 --master_port=29501" in first
    assert "--node_rank=1" in second and "export CUDA_VISIBLE_DEVICES=1,3" in second
    assert "CUDA_VISIBLE_DEVICES" not in first  # slots 0,1: the first two devices
    assert first.endswith(
        "launch --num_nodes=2 --num_gpus=2 --node_rank=0 --master_addr=w0 "
        "--master_port=29501 train.py --deepspeed ds.json"
    )


def test_slurm_command_and_equal_slots():
    cmd = slurm_command(_plan([("w0", [0, 1]), ("w1", [0, 1])]), "--partition=gpu")
    assert cmd[:6] == [
        "srun",
        "--nodes=2",
        "--ntasks=2",
        "--ntasks-per-node=1",
        "--nodelist=w0,w1",
        "--partition=gpu",
    ]
    assert "--node_rank" not in " ".join(cmd)  # each task reads SLURM_NODEID
    with pytest.raises(HostError, match="same number of ranks"):
        slurm_command(_plan([("w0", [0, 1]), ("w1", [0])]), "")


def test_under_srun_the_world_comes_from_slurm(monkeypatch, tmp_path):
    from zero_offload.cli.launch.nodes import plan_nodes
    from zero_offload.cli.main import main

    monkeypatch.setenv("SLURM_STEP_NUM_NODES", "2")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    monkeypatch.setenv("SLURM_NODEID", "1")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "gpu[07-08]")
    args = _args(["--num_gpus", "2", "train.py"])
    assert plan_nodes(args, 0) == (None, {})
    assert (args.num_nodes, args.node_rank, args.master_addr) == (2, 1, "gpu07")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")
    with pytest.raises(HostError, match="one task per node"):
        plan_nodes(_args(["train.py"]), 0)
    bad = tmp_path / ".env"
    bad.write_text("A=1\nnot a pair\n")
    with pytest.raises(HostError, match="line 2"):
        read_env_file(bad)
    assert main(["launch", "--launcher", "openmpi", str(SCRIPT)]) == 2


def _args(argv):
    import argparse

    from zero_offload.cli.launch.command import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


# ---- real launches ----------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD", "MASTER"))}
    env.update(ZERO_OFFLOAD_DEVICE="cpu", ZERO_OFFLOAD_AS_DEEPSPEED="1", OMP_NUM_THREADS="1")
    return env


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("plain") / "out.json"
    env = {k: v for k, v in _env().items() if k != "ZERO_OFFLOAD_AS_DEEPSPEED"}
    cmd = [sys.executable, str(SCRIPT), "--plain", "--out", str(out)]
    subprocess.run(cmd, env=env, check=True, timeout=300)
    return json.loads(out.read_text())


def _launch(tmp_path: Path, entry: list[str], flags: list[str], env: dict) -> dict:
    (tmp_path / "ds.json").write_text(json.dumps(CONFIG))
    out = tmp_path / "out.json"
    cmd = [*entry, *flags, "--master_port", str(_free_port()), str(SCRIPT)]
    cmd += ["--deepspeed", "ds.json", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


def test_deepspeed_command_two_ranks_matches_plain(tmp_path, reference):
    """DeepSpeed's own ``bin/deepspeed`` is ``from deepspeed.launcher.runner import main;
    main()``: run exactly that, with ``--num_gpus 2``."""
    entry = [sys.executable, "-c", "from deepspeed.launcher.runner import main; main()"]
    got = _launch(tmp_path, entry, ["--num_gpus", "2"], _env())
    assert got["world"] == 2 and got["engine"] == "ZeroOffloadEngine"
    assert got["losses"] == pytest.approx(reference["losses"], rel=1e-5)


def test_two_nodes_on_this_machine_over_ssh(tmp_path, reference):
    """A hostfile of two hosts that are both this machine; ``ssh`` replaced by a stand-in that
    runs the remote command here (and records the host): one torchrun per node, node ranks 0
    and 1, the ranks training together."""
    log = tmp_path / "ssh.log"
    fake = tmp_path / "fake_ssh.py"
    fake.write_text(
        "import os, sys\n"
        f"open({str(log)!r}, 'a').write(sys.argv[-2] + '\\n')\n"
        "os.execvp('sh', ['sh', '-c', sys.argv[-1]])\n"
    )
    (tmp_path / "hostfile").write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    env = dict(_env(), ZERO_OFFLOAD_SSH=f"{sys.executable} {fake}")
    got = _launch(tmp_path, [sys.executable, "-m", "deepspeed"], ["--hostfile", "hostfile"], env)
    assert sorted(log.read_text().split()) == ["127.0.0.1", "localhost"]
    assert got["world"] == 2 and got["nodes"] == [0, 1]
    assert got["losses"] == pytest.approx(reference["losses"], rel=1e-5)
