"""``zero-offload`` dispatcher. Each command lives in its own module exposing
``add_arguments(parser)`` and ``run(args) -> int`` (a command with helpers of its own has a
folder, its module ``command.py``); only the chosen command's module is imported,
so one command's heavy imports never slow or break another."""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "train": (
        "zero_offload.cli.train.command",
        "train a GPT-2 on a built-in corpus (the main job)",
    ),
    "launch": (
        "zero_offload.cli.launch.command",
        "launch a script on N ranks (DeepSpeed launcher flags)",
    ),
    "estimate": (
        "zero_offload.cli.estimate.command",
        "memory per device and host, per stage and placement; the largest model that fits",
    ),
    "env": ("zero_offload.cli.env", "report torch, devices and the active host update kernel"),
    "bench": ("zero_offload.cli.bench", "benchmark the host update path against the anchors"),
    "export": ("zero_offload.cli.export", "export a checkpoint as one safetensors state dict"),
    "convert-deepspeed": (
        "zero_offload.cli.convert_deepspeed",
        "convert a DeepSpeed checkpoint into this project's format",
    ),
    "config-docs": (
        "zero_offload.cli.config_docs",
        "write the config reference (docs/config.md) from the config's fields",
    ),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="zero-offload", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", metavar="command")
    sub.required = True
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        if argv and argv[0] == name:  # only the chosen command's module is imported
            importlib.import_module(module).add_arguments(p)
    args = parser.parse_args(argv)
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
