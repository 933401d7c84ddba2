"""``zero-offload launch``'s choice between this node and several, from DeepSpeed's flags.

* A hostfile (``--hostfile``, or DeepSpeed's default ``/job/hostfile`` when it exists) with more
  than one host after ``--include/--exclude/--num_nodes`` (or any, with ``--force_multi``): a
  multi-node launch (:mod:`.multinode`), node 0's address the first host unless
  ``--master_addr`` says otherwise. With ``--no_ssh`` only this node's share starts here, as node
  ``--node_rank`` of the hostfile's world.
* Otherwise this node: ``--include/--exclude localhost:SLOTS`` pick its devices
  (``CUDA_VISIBLE_DEVICES``); inside an ``srun`` step with one task per node the world comes from
  SLURM (nodes, this node's rank, the first node as ``--master_addr``).
"""

from __future__ import annotations

import argparse
import os
from collections import OrderedDict

from .hosts import HostError, parse_hostfile, select_hosts, visible_devices
from .multinode import NodeLaunch, slurm_node

DEFAULT_HOSTFILE = "/job/hostfile"  # DeepSpeed's
LAUNCHERS = ("pdsh", "ssh", "slurm")


def _hostfile(args: argparse.Namespace) -> str | None:
    if args.hostfile is not None:
        if not os.path.isfile(args.hostfile):
            raise HostError(f"--hostfile {args.hostfile}: no such file")
        return args.hostfile
    return DEFAULT_HOSTFILE if os.path.isfile(DEFAULT_HOSTFILE) else None


def plan_nodes(args: argparse.Namespace, cuda_devices: int) -> tuple[NodeLaunch | None, dict]:
    """``(multi-node launch, None)`` or ``(None, environment for this node's ranks)``; for the
    latter ``args`` is completed for this node's torchrun. Raises HostError naming the flag."""
    if args.launcher.lower() not in LAUNCHERS:
        raise HostError(
            f"--launcher {args.launcher!r}: zero_offload starts one torchrun per node with "
            f"{', '.join(LAUNCHERS)} (pdsh means ssh here); MPI launchers are not provided"
        )
    path = _hostfile(args)
    if path is None:
        return None, _this_node(args, cuda_devices)
    hosts = select_hosts(
        parse_hostfile(path), args.include, args.exclude, args.num_nodes, args.num_gpus
    )
    master = args.master_addr or next(iter(hosts))
    if args.no_ssh:
        rank = args.node_rank if args.node_rank is not None else 0
        if not 0 <= rank < len(hosts):
            raise HostError(f"--no_ssh: --node_rank must be in [0, {len(hosts)}), got {rank}")
        slots = list(hosts.values())[rank]
        args.num_nodes, args.node_rank, args.master_addr = len(hosts), rank, master
        args.num_gpus = len(slots)
        return None, visible_devices(slots)
    if len(hosts) > 1 or args.force_multi:
        return (
            NodeLaunch(
                hosts,
                master,
                args.master_port,
                args.script,
                tuple(args.script_args),
                args.module,
                args.timeout,
            ),
            {},
        )
    (slots,) = hosts.values()
    args.num_nodes, args.num_gpus = 1, len(slots)
    return None, visible_devices(slots)


def _this_node(args: argparse.Namespace, cuda_devices: int) -> dict:
    if args.include or args.exclude:
        pool = OrderedDict(localhost=max(cuda_devices, args.num_gpus or 1))
        (slots,) = select_hosts(pool, args.include, args.exclude, None, None).values()
        args.num_gpus = len(slots)
        return visible_devices(slots)
    slurm = slurm_node() if args.node_rank is None else None
    if slurm is not None:
        nodes, rank, first = slurm
        if args.num_nodes not in (None, nodes):
            raise HostError(f"--num_nodes {args.num_nodes}, but this srun step has {nodes} nodes")
        args.num_nodes, args.node_rank = nodes, rank
        args.master_addr = args.master_addr or first
    return {}
