"""Top-level keys written with dots: ``"zero_optimization.reduce_bucket_size": 4096`` is the
nested key it spells.

TRL's ``prepare_deepspeed`` (the reference model of DPO/KTO, GKD teachers, GRPO with a KL term)
copies the Trainer's DeepSpeed config and adds three such keys for ZeRO-3
(``zero_optimization.reduce_bucket_size``, ``.stage3_param_persistence_threshold``,
``.stage3_prefetch_bucket_size``). DeepSpeed drops them unread; here each one is applied as the
nested key it spells, so the second engine is configured as TRL meant. Rules:

* the dotted key wins over the same key given nested (it is the later, more specific setting,
  as TRL writes it over the Trainer's config); another spelling of the same stage-3 setting
  beside it is replaced, not reported as a conflict;
* every segment must be a key of the section it names (or one accepted and ignored there), and
  every segment but the last a section: otherwise a ConfigError names the dotted key;
* a fractional number for an integer key (TRL writes ``0.9 * hidden_size**2`` for the prefetch
  bucket) is its integer part: these keys are element counts.
"""

from __future__ import annotations

import math
import typing
from typing import Annotated, Any

from ..errors import json_repr, unknown_key_message
from ..fields import Section, sections_in
from ..zero.zero_optimization import STAGE3_SPELLINGS

# every spelling of a stage-3 setting -> all its spellings
_SPELLINGS = {
    spelling: (name, *aliases)
    for name, aliases in STAGE3_SPELLINGS.items()
    for spelling in (name, *aliases)
}


def expand_dotted_keys(
    raw: dict[str, Any], model: type[Section], problems: list[str]
) -> dict[str, Any]:
    """``raw`` with each dotted top-level key moved to the nested place it spells (a new dict;
    ``raw`` and its sections are not modified). A key whose path is not valid is left out and
    its problem appended to ``problems``."""
    dotted = [k for k in raw if isinstance(k, str) and "." in k]
    if not dotted:
        return raw
    out = {k: v for k, v in raw.items() if k not in dotted}
    for key in dotted:
        parts = key.split(".")
        leaf, problem = _resolve(model, parts, out)
        if problem is not None:
            problems.append(f'dotted key "{key}": {problem}')
            continue
        _apply(out, parts, _as_field_value(leaf, parts[-1], raw[key]))
    return out


def _resolve(
    model: type[Section], parts: list[str], data: dict[str, Any]
) -> tuple[type[Section] | None, str | None]:
    """The section holding the last segment, or the reason the path is not a key."""
    section: type[Section] | None = model
    node: Any = data
    for depth, part in enumerate(parts):
        path = ".".join(parts[:depth])
        if not part:
            return None, "an empty segment (write each key between single dots)"
        if section is not None:
            known = section.known_keys()
            if part not in known and part not in section.NOT_IMPLEMENTED:
                return None, unknown_key_message(path, part, known, None, section.NOT_IMPLEMENTED)
        if depth == len(parts) - 1:
            return section, None
        child = node.get(part) if isinstance(node, dict) else None
        if child is not None and not isinstance(child, dict):
            where = ".".join(parts[: depth + 1])
            return None, f'"{where}" is {json_repr(child)} here, not a section with keys'
        if section is not None and part not in section.NOT_IMPLEMENTED:
            nested = section.nested_section(part, node if isinstance(node, dict) else {})
            if nested is None and not _holds_sections(section, part):
                where = ".".join(parts[: depth + 1])
                return None, f'"{where}" is a value, not a section with keys'
            section = nested
        else:
            section = None  # inside an ignored section: the walk lists it, nothing to check
        node = child
    return section, None


def _holds_sections(section: type[Section], key: str) -> bool:
    """Whether ``key`` holds a section chosen by its contents (the optimizer's or scheduler's
    ``type``) or free-form keys: a dotted path may go on into it, and validation judges the
    rest."""
    field = section.model_fields.get(key)
    if field is None:
        return False
    annotation = field.annotation
    return typing.get_origin(annotation) is dict or bool(sections_in(annotation))


def _apply(out: dict[str, Any], parts: list[str], value: Any) -> None:
    node = out
    for part in parts[:-1]:
        child = node.get(part)
        node[part] = dict(child) if isinstance(child, dict) else {}
        node = node[part]
    for spelling in _SPELLINGS.get(parts[-1], ()):
        node.pop(spelling, None)
    node[parts[-1]] = value


def _as_field_value(section: type[Section] | None, key: str, value: Any) -> Any:
    """A fractional finite number for an integer key is its integer part; anything else as is
    (validation judges it)."""
    if (
        section is None
        or isinstance(value, bool)
        or not isinstance(value, float)
        or not math.isfinite(value)
        or value.is_integer()
    ):
        return value
    key = _SPELLINGS.get(key, (key,))[0]  # a field goes by its stage3_ name
    field = next(
        (f for name, f in section.model_fields.items() if key in (name, f.alias)),
        None,
    )
    if field is None:
        return value
    annotation = field.annotation
    if typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    return int(value) if annotation is int else value
