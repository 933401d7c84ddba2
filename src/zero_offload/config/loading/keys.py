"""Walking the raw config against the section models before validation.

Each key is either known (kept), a DeepSpeed key this project ignores (dropped and listed for
the warning), ``"auto"`` (dropped: Hugging Face's "fill this in"; what fills it, or the default
chosen instead, is decided in :mod:`.auto`), or
unknown (an error naming the full path and the closest valid key). Pydantic's own errors are
turned into the same one-line-per-problem form by :func:`describe_errors`.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from ..errors import join_path, json_repr, unknown_key_message
from ..fields import Section, sections_in

AUTO = "auto"


@dataclass
class Prepared:
    """The raw config cleaned for validation, and what the walk found on the way."""

    data: dict[str, Any]
    problems: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    ignored_values: dict[str, Any] = field(default_factory=dict)  # by path, as given
    auto: set[str] = field(default_factory=set)


def prepare(raw: dict[str, Any], model: type[Section]) -> Prepared:
    result = Prepared(data={})
    result.data = _walk(model, raw, "", result)
    return result


def _walk(model: type[Section], raw: dict[str, Any], path: str, out: Prepared) -> dict[str, Any]:
    known = model.known_keys()
    cleaned: dict[str, Any] = {}
    for key, value in raw.items():
        full = join_path(path, key)
        if key in model.NOT_IMPLEMENTED:
            out.ignored.append(full)
            out.ignored_values[full] = value
            if isinstance(value, str) and value == AUTO:
                out.auto.add(full)  # still ignored here; recorded for whoever can fill it
        elif key not in known:
            hint = model.KEY_HINTS.get(key)
            out.problems.append(
                unknown_key_message(path, key, known, hint, accepted=model.NOT_IMPLEMENTED)
            )
        elif isinstance(value, str) and value == AUTO and key not in model.AUTO_IS_A_VALUE:
            out.auto.add(full)
        else:
            child = model.nested_section(key, raw)
            if child is not None and isinstance(value, dict):
                value = _walk(child, value, full, out)
            cleaned[key] = value
    return cleaned


def _tag_matches(section: type[Section], tag: str) -> bool:
    """Whether ``tag`` is the discriminator value (the Literal ``type``) of ``section``."""
    type_field = section.model_fields.get("type")
    return type_field is not None and tag in typing.get_args(type_field.annotation)


def key_path(model: type[Section], loc: tuple[str | int, ...]) -> str:
    """A pydantic error location as the user's key path: union tags and other schema-only
    location parts are dropped, list indices become ``[i]``."""
    parts: list[str] = []
    candidates: list[type[Section]] = [model]
    for element in loc:
        if isinstance(element, int):
            parts.append(f"[{element}]")
            candidates = []
            continue
        owner = next((c for c in candidates if element in c.model_fields), None)
        if owner is not None:
            parts.append(element)
            candidates = sections_in(owner.model_fields[element].annotation)
        elif candidates:
            # A discriminated-union tag ("WarmupLR"): narrow to that member, add nothing.
            candidates = [c for c in candidates if _tag_matches(c, element)] or candidates
        else:
            parts.append(element)
    text = ""
    for part in parts:
        text = text + part if part.startswith("[") else join_path(text, part)
    return text


_BOUNDS = {
    "greater_than": (">", "gt"),
    "greater_than_equal": (">=", "ge"),
    "less_than": ("<", "lt"),
    "less_than_equal": ("<=", "le"),
}
_OBJECT_TYPES = {"model_type", "model_attributes_type", "dict_type"}


def _describe(model: type[Section], error: Any, auto: set[str]) -> str:
    path = key_path(model, tuple(error["loc"]))
    kind, ctx = error["type"], error.get("ctx") or {}
    got = f" (got {json_repr(error.get('input'))})"
    if kind == "config_rule":
        path = join_path(path, ctx["key"])
        message = ctx["msg"]
    elif kind == "missing":
        message = "required"
        if path in auto:
            message += ' ("auto" has nothing to fill it from here; give a value)'
    elif kind in _BOUNDS:
        symbol, name = _BOUNDS[kind]
        message = f"must be {symbol} {ctx[name]}{got}"
    elif kind == "literal_error":
        message = f"allowed: {ctx['expected']}{got}"
    elif kind in _OBJECT_TYPES:
        message = f"must be a JSON object{got}"
    elif kind in {"tuple_type", "list_type"}:
        message = f"must be a JSON list{got}"
    elif kind == "value_error":
        message = str(error["msg"]).removeprefix("Value error, ")
    else:
        message = f"{error['msg']}{got}"
    return f"{path}: {message}" if path else message


def describe_errors(model: type[Section], exc: ValidationError, auto: set[str]) -> list[str]:
    """One line per pydantic error, each starting with the full key path."""
    return [_describe(model, error, auto) for error in exc.errors(include_url=False)]
