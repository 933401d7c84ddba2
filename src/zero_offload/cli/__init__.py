"""Command-line entry points: ``zero-offload <command>``."""
