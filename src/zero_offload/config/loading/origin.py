"""Which file a config dict was read from, for the messages about it.

Hugging Face's Trainer and Accelerate read a DeepSpeed config file themselves and hand
``deepspeed.initialize`` the dict, so the file's name is lost on the way; messages would name
the config ``<dict>``. Under the opt-in, their reader records the file beside the dict it made
(:func:`remember`), and the namespace passes the dict on as a :class:`NamedConfig`, which
``load_config`` names by its file.
"""

from __future__ import annotations

import os
from typing import Any

# id(dict) -> (the dict, its file). The dict is held, so its id cannot be reused meanwhile.
_FILES: dict[int, tuple[dict[str, Any], str]] = {}


class NamedConfig(dict):
    """A config dict that knows the file it was read from."""

    def __init__(self, data: dict[str, Any], origin: str) -> None:
        super().__init__(data)
        self.origin = origin


def remember(config: Any, path: Any) -> None:
    """Record that ``config`` (a dict) was read from the file ``path``."""
    if isinstance(config, dict) and isinstance(path, (str, os.PathLike)):
        _FILES[id(config)] = (config, os.fspath(path))


def origin_of(config: Any) -> str | None:
    """The file ``config`` was read from, if recorded."""
    if isinstance(config, NamedConfig):
        return config.origin
    entry = _FILES.get(id(config))
    return entry[1] if entry is not None and entry[0] is config else None
