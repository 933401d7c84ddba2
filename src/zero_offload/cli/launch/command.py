"""``zero-offload launch``: the DeepSpeed launcher's flags, run by torchrun.

``zero-offload launch --num_gpus 2 train.py --deepspeed_config ds.json`` starts two ranks of
``train.py`` on this node, exactly as ``deepspeed --num_gpus 2 train.py ...`` would. On a machine
without CUDA each "GPU" is a CPU process on the gloo backend. Several nodes, as DeepSpeed's
launcher runs them: ``--hostfile`` (``HOST slots=N`` lines) with ``--include/--exclude/
--num_nodes/--num_gpus``, one torchrun per node started over ssh (``--launcher pdsh``/``ssh``) or
srun (``--launcher slurm``) (``nodes``, ``multinode``); or the same command on every node
with its own ``--node_rank`` and the first node's ``--master_addr``; or one task per node under
``srun``, which supplies both. The ``deepspeed`` command (``deepspeed.launcher.runner.main``)
under the opt-in is this command.
"""

from __future__ import annotations

import argparse
import os
import sys

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500  # DeepSpeed's and torchrun's default


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--num_nodes",
        type=int,
        default=None,
        help="number of nodes (default 1; with a hostfile: its first N hosts, default all)",
    )
    parser.add_argument(
        "--num_gpus",
        "--num_accelerators",
        type=int,
        default=None,
        help="ranks per node (default: the CUDA devices here, or 1 without CUDA; "
        "without CUDA or with ZERO_OFFLOAD_DEVICE=cpu, N means N CPU ranks on gloo)",
    )
    parser.add_argument(
        "--node_rank",
        type=int,
        default=None,
        help="this node's rank (default 0, or SLURM's under srun)",
    )
    parser.add_argument(
        "--master_addr",
        default=None,
        help=f"address of node 0 (default {DEFAULT_MASTER_ADDR}; required with --num_nodes > 1)",
    )
    parser.add_argument(
        "--master_port",
        type=int,
        default=DEFAULT_MASTER_PORT,
        help=f"TCP port on node 0 for the rendezvous (default {DEFAULT_MASTER_PORT})",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds a collective waits for the other ranks before failing with an error that "
        "names it (default: $DEEPSPEED_TIMEOUT minutes, else 600 s, as in DeepSpeed); exported "
        "to the ranks as $ZERO_OFFLOAD_TIMEOUT, which every route's init_distributed reads "
        "(deepspeed.initialize's too) unless the script passes its own timeout",
    )
    _add_multinode_arguments(parser)
    parser.add_argument(
        "--module",
        action="store_true",
        help="treat the script as a module name and run it as 'python -m script'",
    )
    parser.add_argument("script", help="the training script (or module, with --module)")
    # REMAINDER: everything after the script is the script's, including its --flags.
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's arguments")


def _add_multinode_arguments(parser: argparse.ArgumentParser) -> None:
    """DeepSpeed's launcher flags for several nodes (``nodes`` reads them)."""
    parser.add_argument(
        "-H",
        "--hostfile",
        default=None,
        help="'HOST slots=N' per line: the nodes to launch on (default /job/hostfile if present)",
    )
    parser.add_argument(
        "-i", "--include", default="", help="hosts/slots to use: HOST[:SLOT,SLOT][@HOST...]"
    )
    parser.add_argument("-e", "--exclude", default="", help="hosts/slots to leave out (as -i)")
    parser.add_argument(
        "--launcher",
        default="pdsh",
        help="how each node's torchrun starts: pdsh or ssh (one ssh per node), slurm (srun)",
    )
    parser.add_argument("--launcher_args", default="", help="extra arguments for srun")
    parser.add_argument("--ssh_port", type=int, default=None, help="ssh port of the nodes")
    parser.add_argument(
        "--no_ssh",
        action="store_true",
        help="with a hostfile: start only this node's ranks (node --node_rank of its world)",
    )
    parser.add_argument(
        "--force_multi", action="store_true", help="the multi-node path even for one host"
    )
    parser.add_argument(
        "--no_ssh_check", action="store_true", help="accepted (no ssh probe is made)"
    )


def torchrun_argv(args: argparse.Namespace, cuda_devices: int) -> list[str]:
    """torchrun's argument list for ``args``. Raises ValueError naming the bad flag."""
    num_nodes = args.num_nodes if args.num_nodes is not None else 1
    node_rank = args.node_rank if args.node_rank is not None else 0
    if num_nodes < 1:
        raise ValueError(f"--num_nodes must be at least 1, got {num_nodes}")
    num_gpus = args.num_gpus if args.num_gpus is not None else max(cuda_devices, 1)
    if num_gpus < 1:
        raise ValueError(f"--num_gpus must be at least 1, got {num_gpus}")
    if cuda_devices > 0 and num_gpus > cuda_devices:
        raise ValueError(
            f"--num_gpus {num_gpus} asks for more ranks than the {cuda_devices} CUDA "
            "device(s) on this node"
        )
    if not 0 <= node_rank < num_nodes:
        raise ValueError(f"--node_rank must be in [0, --num_nodes={num_nodes}), got {node_rank}")
    if not 1 <= args.master_port <= 65535:
        raise ValueError(f"--master_port must be in [1, 65535], got {args.master_port}")
    if getattr(args, "timeout", None) is not None:
        from ...core.dist import as_timeout

        try:
            as_timeout(args.timeout)
        except ValueError as err:
            raise ValueError(f"--timeout: {err}") from None
    if num_nodes > 1 and not args.master_addr:
        raise ValueError("--master_addr is required with --num_nodes > 1 (node 0's address)")
    if not args.module and not os.path.isfile(args.script):
        raise ValueError(
            f"script {args.script!r} is not a file (use --module to run a module by name)"
        )
    argv = [
        f"--nnodes={num_nodes}",
        f"--nproc_per_node={num_gpus}",
        f"--node_rank={node_rank}",
        f"--master_addr={args.master_addr or DEFAULT_MASTER_ADDR}",
        f"--master_port={args.master_port}",
    ]
    if args.module:
        argv.append("--module")
    return [*argv, args.script, *args.script_args]


def threads_per_rank(ranks_per_node: int, cpus: int) -> int:
    """An even share of this node's cores for each rank's intra-op threads.

    torchrun alone sets OMP_NUM_THREADS=1 for several ranks per node, which would leave the host
    Adam of ZeRO-Offload one core per rank while the rest of the machine idles.
    """
    return max(1, cpus // max(1, ranks_per_node))


def _run_nodes(nodes, args: argparse.Namespace) -> int:
    """One ``zero-offload launch`` per node, over ssh or srun (``multinode``)."""
    from .multinode import exports, run_all, slurm_command, ssh_commands

    if args.launcher.lower() == "slurm":
        return run_all([slurm_command(nodes, args.launcher_args)])
    cwd = os.path.abspath(".")
    return run_all(ssh_commands(nodes, exports(dict(os.environ), cwd), cwd, args.ssh_port))


def run(args: argparse.Namespace) -> int:
    import torch
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    from ...core.dist import uses_cuda
    from .nodes import plan_nodes

    cuda_devices = torch.cuda.device_count() if uses_cuda() else 0
    try:
        nodes, node_env = plan_nodes(args, cuda_devices)
        if nodes is not None:
            return _run_nodes(nodes, args)
        argv = torchrun_argv(args, cuda_devices)
    except ValueError as err:
        print(f"zero-offload launch: error: {err}", file=sys.stderr)
        return 2
    os.environ.update(node_env)  # this node's devices (--include); torchrun passes it on
    ranks_per_node = args.num_gpus if args.num_gpus is not None else max(cuda_devices, 1)
    from ...core.dist import TIMEOUT_ENV

    user_timeout = os.environ.get(TIMEOUT_ENV)
    if args.timeout is not None:  # read by init_distributed() in every rank
        os.environ[TIMEOUT_ENV] = repr(float(args.timeout))
    user_threads = os.environ.get("OMP_NUM_THREADS")
    if user_threads is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        # torchrun hands its own environment to the ranks; restored below for in-process callers.
        os.environ["OMP_NUM_THREADS"] = str(threads_per_rank(ranks_per_node, cpus or 1))
    try:
        torchrun_main(argv)
    except ChildFailedError:
        # torchrun has already printed each failed rank's exit code and traceback.
        return 1
    finally:
        if user_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        if user_timeout is None:
            os.environ.pop(TIMEOUT_ENV, None)
        else:
            os.environ[TIMEOUT_ENV] = user_timeout
    return 0
