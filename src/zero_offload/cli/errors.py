"""How every command reports a user error: one line per problem on stderr, no traceback."""

from __future__ import annotations

import sys


def report(command: str, err: BaseException, config_path: str | None = None) -> int:
    """Print ``zero-offload <command>: error: ...`` to stderr and return exit status 2.

    A config error prints one line per problem, each naming the config file and the key path
    (``error: ds.json: zero_optimization.stage: ...``)."""
    from zero_offload.config import ConfigError

    prefix = f"zero-offload {command}: error:"
    if isinstance(err, ConfigError):
        origin = config_path or err.origin
        where = f" {origin}:" if origin and not origin.startswith("<") else ""
        for problem in err.problems:
            print(f"{prefix}{where} {problem}", file=sys.stderr)
    else:
        print(f"{prefix} {err}", file=sys.stderr)
    return 2
