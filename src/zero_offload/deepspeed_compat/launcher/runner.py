"""``deepspeed.launcher.runner``: the ``deepspeed`` command (``main``), which is ``zero-offload
launch`` with DeepSpeed's launcher flags (``--num_gpus``, ``--hostfile``, ``--include`` /
``--exclude``, ``--num_nodes``, ``--master_addr`` / ``--master_port``, ``--launcher``; one
torchrun per node), and the name of the environment file DeepSpeed's multi-node launcher passes to
every node (read by accelerate).

An installed DeepSpeed's ``deepspeed`` script (``from deepspeed.launcher.runner import main``)
runs this under the opt-in; without DeepSpeed, ``python -m deepspeed ...`` does (the namespace's
``__main__``)."""

from __future__ import annotations

import os
import sys

from .._common import not_provided_getattr

DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")


def main(args: list[str] | None = None) -> None:
    """DeepSpeed's ``runner.main(args=None)``: launch ``user_script`` with ``args`` (default
    ``sys.argv[1:]``); exits with the launch's status."""
    from ...cli.main import main as cli_main

    argv = sys.argv[1:] if args is None else list(args)
    sys.exit(cli_main(["launch", *argv]))


__getattr__ = not_provided_getattr(__name__)
