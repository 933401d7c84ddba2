"""Multi-node launch: one ``zero-offload launch`` (so one torchrun) per node, started as
DeepSpeed's launcher starts its per-node launcher.

* ``--launcher pdsh`` (DeepSpeed's default) or ``ssh``: one ``ssh HOST 'cd CWD; export ...;
  python -m zero_offload.cli.main launch --node_rank I ...'`` per node, all at once (pdsh's fan-out
  without needing pdsh); the first failing node stops the others. ``$ZERO_OFFLOAD_SSH`` replaces
  the ``ssh`` command (``ssh -i KEY``, or a local stand-in in tests).
* ``--launcher slurm``: one ``srun --nodes N --ntasks-per-node 1 --nodelist H1,H2 ... launch``;
  each task takes its node rank from ``$SLURM_NODEID`` (see :func:`slurm_node`).

Exported to every node, as DeepSpeed exports them: the variables whose names start with one of
:data:`EXPORT_PREFIXES`, the lines of ``.deepspeed_env`` (``$DS_ENV_FILE``) in the working
directory and the home directory, ``PYTHONPATH`` with the working directory first, and, where a
node uses a subset of its slots, ``CUDA_VISIBLE_DEVICES`` with those slots.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from .hosts import HostError, expand_nodelist, visible_devices

# DeepSpeed's EXPORT_ENVS and CUDA's NCCL, plus this project's and the Hugging Face libraries'
EXPORT_PREFIXES = (
    "PYTHON",
    "MLFLOW",
    "MV2",
    "UCX",
    "NCCL",
    "ZERO_OFFLOAD_",
    "HF_",
    "TRANSFORMERS_",
    "TOKENIZERS_",
    "OMP_NUM_THREADS",
)
ENV_FILE = os.environ.get("DS_ENV_FILE", ".deepspeed_env")


@dataclass(frozen=True)
class NodeLaunch:
    """What every node runs: the world's shape and the script (``--module``: a module name)."""

    hosts: OrderedDict[str, list[int]]
    master_addr: str
    master_port: int
    script: str
    script_args: tuple[str, ...]
    module: bool = False
    timeout: float | None = None

    def launch_argv(self, node_rank: int | None) -> list[str]:
        """``zero-offload launch`` for one node (``node_rank`` None: taken from SLURM)."""
        slots = list(self.hosts.values())
        argv = [sys.executable, "-u", "-m", "zero_offload.cli.main", "launch"]
        argv += [f"--num_nodes={len(slots)}"]
        if node_rank is not None:
            argv += [f"--num_gpus={len(slots[node_rank])}", f"--node_rank={node_rank}"]
        else:
            argv += [f"--num_gpus={len(slots[0])}"]
        argv += [f"--master_addr={self.master_addr}", f"--master_port={self.master_port}"]
        if self.timeout is not None:
            argv.append(f"--timeout={self.timeout}")
        if self.module:
            argv.append("--module")
        return [*argv, self.script, *self.script_args]


def read_env_file(path: Path) -> dict[str, str]:
    """``KEY=VALUE`` lines (blank lines and ``#`` comments skipped); a bad line names itself."""
    out = {}
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise HostError(f"{path}, line {number}: {raw!r} is not KEY=VALUE")
        out[key.strip()] = value
    return out


def exports(environ: dict[str, str], cwd: str) -> dict[str, str]:
    """The variables every node gets (see the module docstring)."""
    out = {k: v for k, v in environ.items() if k.startswith(EXPORT_PREFIXES)}
    path = environ.get("PYTHONPATH")
    out["PYTHONPATH"] = cwd + (os.pathsep + path if path else "")
    for folder in (cwd, os.path.expanduser("~")):
        env_file = Path(folder) / ENV_FILE
        if env_file.is_file():
            out.update(read_env_file(env_file))
    return out


def ssh_commands(
    plan: NodeLaunch, env: dict[str, str], cwd: str, ssh_port: int | None
) -> list[list[str]]:
    """One ssh command per node, in node-rank order."""
    ssh = shlex.split(os.environ.get("ZERO_OFFLOAD_SSH", "ssh"))
    if ssh_port is not None:
        ssh += ["-p", str(ssh_port)]
    out = []
    for rank, (host, slots) in enumerate(plan.hosts.items()):
        node_env = {**env, **visible_devices(slots)}
        remote = [f"cd {shlex.quote(cwd)}"]
        remote += [f"export {k}={shlex.quote(v)}" for k, v in node_env.items()]
        remote.append("exec " + shlex.join(plan.launch_argv(rank)))
        out.append([*ssh, host, "; ".join(remote)])
    return out


def slurm_command(plan: NodeLaunch, launcher_args: str) -> list[str]:
    """One srun that starts one ``launch`` per node; every node uses as many slots."""
    counts = {len(s) for s in plan.hosts.values()}
    if len(counts) != 1:
        raise HostError(
            "--launcher slurm starts the same number of ranks on every node; the hosts use "
            + ", ".join(f"{h}: {len(s)}" for h, s in plan.hosts.items())
        )
    n = len(plan.hosts)
    srun = ["srun", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1"]
    srun += [f"--nodelist={','.join(plan.hosts)}", *shlex.split(launcher_args)]
    return [*srun, *plan.launch_argv(None)]


def slurm_node() -> tuple[int, int, str] | None:
    """Inside an ``srun`` step with one task per node: (nodes, this node's rank, the first node's
    name); None outside one. Several tasks per node would start several launchers per node."""
    env = os.environ
    keys = ("SLURM_STEP_NUM_NODES", "SLURM_NODEID", "SLURM_STEP_NODELIST")
    if not all(k in env for k in keys):
        return None
    nodes, tasks = int(env["SLURM_STEP_NUM_NODES"]), int(env.get("SLURM_STEP_NUM_TASKS", "0"))
    if tasks and tasks != nodes:
        raise HostError(
            f"under srun with {tasks} tasks on {nodes} node(s): run one task per node "
            "(srun --ntasks-per-node=1), each task launches its node's ranks"
        )
    return nodes, int(env["SLURM_NODEID"]), expand_nodelist(env["SLURM_STEP_NODELIST"])[0]


def run_all(commands: list[list[str]], env: dict[str, str] | None = None) -> int:
    """Start every command; when one fails, stop the others. Returns the first failure's exit
    code (0 when all succeed)."""
    procs = [subprocess.Popen(c, env=env, start_new_session=True) for c in commands]
    failed = 0
    try:
        while any(p.poll() is None for p in procs):
            bad = [p.returncode for p in procs if p.returncode not in (None, 0)]
            if bad:
                failed = bad[0]
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            p.wait()
    return failed or next((p.returncode for p in procs if p.returncode), 0)
