"""Config errors and warnings, and the helpers that make their messages name the key."""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable, Sequence
from typing import Any


class DeepSpeedConfigError(Exception):
    """DeepSpeed's config error class (``deepspeed.runtime.config.DeepSpeedConfigError``).

    Every :class:`ConfigError` is one, so code written for DeepSpeed (``except
    DeepSpeedConfigError``) catches this project's config errors too."""


class ConfigError(ValueError, AssertionError, DeepSpeedConfigError):
    """A config the project cannot run. ``problems`` holds one line per problem, each naming
    the full key path (``zero_optimization.stage``) and what is allowed.

    DeepSpeed refuses a bad config with a pydantic ValidationError (a ValueError), an
    ``assert`` (AssertionError: the batch triple, fp16 with bf16) or its DeepSpeedConfigError;
    a ConfigError is all three, so whichever one a DeepSpeed script catches, it catches this."""

    def __init__(self, problems: str | Sequence[str], origin: str | None = None) -> None:
        self.problems: list[str] = [problems] if isinstance(problems, str) else list(problems)
        self.origin = origin
        if origin is None and len(self.problems) == 1:
            text = self.problems[0]
        else:
            where = f" {origin}" if origin else ""
            count = len(self.problems)
            noun = "problem" if count == 1 else "problems"
            text = f"invalid config{where} ({count} {noun}):\n  " + "\n  ".join(self.problems)
        super().__init__(text)


class NotImplementedSettingWarning(UserWarning):
    """A DeepSpeed setting the config accepts but this project does not act on."""


class SettingSpellingWarning(UserWarning):
    """Two spellings of one setting given with different values; the message names both keys
    and the value used."""


def json_repr(value: Any) -> str:
    """The value as the user wrote it in JSON (``true``, ``"cpu"``, ``5e-05``)."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def join_path(prefix: str, key: str) -> str:
    if not key:
        return prefix
    return f"{prefix}.{key}" if prefix else key


def unknown_key_message(
    path: str,
    key: str,
    valid: Iterable[str],
    hint: str | None = None,
    accepted: Iterable[str] = (),
) -> str:
    """``unknown key "a.b"; did you mean "c"?`` -- the closest key at the same level (``valid``
    or ``accepted``-but-ignored ones), or the list of ``valid`` keys when nothing is close."""
    full = join_path(path, key)
    if hint:
        return f'unknown key "{full}": {hint}'
    candidates = sorted(set(valid))
    close = difflib.get_close_matches(key, [*candidates, *sorted(accepted)], n=1, cutoff=0.6)
    if close:
        return f'unknown key "{full}"; did you mean "{close[0]}"?'
    return f'unknown key "{full}"; valid keys here: {", ".join(candidates)}'
