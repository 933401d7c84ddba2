"""Reading a config: JSON, with the two slips DeepSpeed's own tutorials print, and Hjson files.

Strict JSON is tried first. Only when that fails are two repairs tried: a trailing comma
before ``}``/``]`` is dropped, and a missing comma is added between a value that ends a line
(``}``, ``]``, a string, a number, true/false/null) and a ``"key":`` on a later line. The
repaired text must then parse; one warning names every repaired line. A config *file* that is
still not JSON is then read as Hjson when the optional ``hjson`` package is importable, as
DeepSpeed reads every config file (``hjson.load``: comments, unquoted keys and strings,
trailing and missing commas), without a warning. Anything else is a ConfigError with the line
and column of the original text (and, for a file read as Hjson, of the Hjson error too). A key
given twice in one object is an error either way (DeepSpeed refuses duplicates too), and so
is NaN or Infinity.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from types import ModuleType
from typing import Any

from ..errors import ConfigError

_DELIMITERS = set('{}[],:"') | set(" \t\r\n")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            # json keeps the last silently; a config that says two things means neither.
            raise ConfigError(f'duplicate key "{key}" in one JSON object')
        out[key] = value
    return out


def _no_constants(name: str) -> Any:
    raise ConfigError(f"{name} is not a number a config may hold")


def _loads(text: str) -> Any:
    return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constants)


def _hjson_module() -> ModuleType | None:
    """The ``hjson`` package, or None when it is not installed (an optional dependency)."""
    try:
        import hjson
    except ImportError:
        return None
    return hjson


class _OutOfRange(float):
    """An Hjson number literal beyond float range (``1e999``). Hjson's reader calls ``int()``
    on every float literal, which fails on infinity; this one answers, so the literal is read
    as infinity and the non-finite scan of the loader names its key, as for JSON."""

    def __int__(self) -> int:
        return 0


def _hjson_float(text: str) -> float:
    value = float(text)
    return value if math.isfinite(value) else _OutOfRange(value)


def _hjson_loads(hjson: ModuleType, text: str, json_error: str) -> Any:
    """``text`` read as Hjson; if it is not Hjson either, a ConfigError with both errors."""
    try:
        return hjson.loads(text, object_pairs_hook=_no_duplicates, parse_float=_hjson_float)
    except ConfigError:
        raise
    except hjson.HjsonDecodeError as exc:
        raise ConfigError(
            f"{json_error}; read as Hjson (as DeepSpeed reads config files): invalid at line "
            f"{exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    except (ValueError, OverflowError, RecursionError) as exc:  # a 5000-digit integer, ...
        raise ConfigError(
            f"{json_error}; read as Hjson (as DeepSpeed reads config files): {exc}"
        ) from None


def _string_end(text: str, start: int) -> int:
    """Index just past the string that opens at ``start`` (or len(text) if unterminated)."""
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == '"':
            return i + 1
        i += 1
    return len(text)


def _next_significant(text: str, i: int) -> str:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return text[i] if i < len(text) else ""


def repair(text: str) -> tuple[str, list[str]]:
    """The text with trailing commas removed and missing key commas added, and one note per
    repair (1-based line numbers of the original text)."""
    pieces: list[str] = []
    notes: list[str] = []
    # The last token that matters for a comma: kind, index in pieces, and its line.
    last_kind, last_index, last_line = "", -1, 0
    line, i, n = 1, 0, len(text)
    while i < n:
        c = text[i]
        if c in " \t\r\n":
            line += c == "\n"
            pieces.append(c)
            i += 1
            continue
        if c == '"':
            end = _string_end(text, i)
            is_key = _next_significant(text, end) == ":"
            if is_key and last_kind == "value" and last_line < line:
                pieces[last_index] += ","
                notes.append(f"added the missing comma at the end of line {last_line}")
            pieces.append(text[i:end])
            line += text.count("\n", i, end)
            last_kind, last_index, last_line = "value", len(pieces) - 1, line
            i = end
            continue
        if c in "}]":
            if last_kind == "comma":
                pieces[last_index] = ""
                notes.append(f"removed the trailing comma on line {last_line}")
            pieces.append(c)
            last_kind, last_index, last_line = "value", len(pieces) - 1, line
        elif c == ",":
            pieces.append(c)
            last_kind, last_index, last_line = "comma", len(pieces) - 1, line
        elif c in "{[:":
            pieces.append(c)
            last_kind, last_index, last_line = "open", len(pieces) - 1, line
        else:
            end = i
            while end < n and text[end] not in _DELIMITERS:
                end += 1
            end = max(end, i + 1)
            pieces.append(text[i:end])
            last_kind, last_index, last_line = "value", len(pieces) - 1, line
            i = end
            continue
        i += 1
    return "".join(pieces), notes


def parse_json_text(text: str, origin: str = "<config>", *, hjson: bool = False) -> dict[str, Any]:
    """The JSON object in ``text``; ``origin`` names it in errors and in the repair warning.

    ``hjson``: text that is neither strict JSON nor repaired by the two repairs is then read
    as Hjson (as DeepSpeed reads a config file) when the hjson package is importable."""
    try:
        data = _loads(text)
    except json.JSONDecodeError as first:
        repaired, notes = repair(text)
        try:
            data = _loads(repaired) if notes else None
        except json.JSONDecodeError:
            data = None
        if data is None:
            message = (
                f"{origin}: invalid JSON at line {first.lineno} column {first.colno}: {first.msg}"
            )
            module = _hjson_module() if hjson else None
            if module is None:
                raise ConfigError(message) from None
            return _config_object(_hjson_loads(module, text, message), origin)
        warnings.warn(f"{origin}: repaired JSON: {'; '.join(notes)}", UserWarning, stacklevel=2)
    return _config_object(data, origin)


def _config_object(data: Any, origin: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: a config must be a JSON object, got {type(data).__name__}")
    return data


def read_json_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The config object in the file at ``path``: JSON, or Hjson when the hjson package is
    importable (see :func:`parse_json_text`)."""
    name = os.fspath(path)
    try:
        with open(name, encoding="utf-8") as handle:
            text = handle.read()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {name}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {name}: {exc}") from None
    return parse_json_text(text, origin=name, hjson=True)
