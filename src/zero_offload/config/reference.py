"""The config reference, ``docs/config.md``, generated from the field declarations: each section's
keys with their type, default and description (``Field(description=...)``), the other spellings
accepted, and the DeepSpeed keys accepted but not built. ``zero-offload config-docs`` writes it,
and a test fails when the file differs from :func:`render`, so the page cannot drift from the
code: a key, default or description changes in one place only.
"""

from __future__ import annotations

import json
import re
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

import annotated_types
from pydantic.fields import FieldInfo

from .fields import Section, sections_in
from .loading.removed import REMOVED_OPTIMIZERS, REMOVED_TOP_LEVEL, REMOVED_ZERO
from .models import ZeroOffloadConfig
from .zero.zero_optimization import STAGE3_SPELLINGS, ZeroConfig

# Other JSON spellings of a field, by section (the key walker accepts them; see zero.py).
ALIASES: dict[type[Section], dict[str, tuple[str, ...]]] = {ZeroConfig: STAGE3_SPELLINGS}

HEADER = """\
<!-- Generated from the field declarations in src/zero_offload/config/ by
     `zero-offload config-docs --out docs/config.md`; edit those, not this file. -->

# Config reference

Every key of the JSON config, section by section, with its type, default and meaning. Key names,
defaults and meanings are DeepSpeed's unless the description says *this project's extension*.
Sizes are in elements unless a unit is named. `"auto"` (Hugging Face's "fill this in") loads
for any key: the batch keys and the `zero_optimization` sizes that say so are filled, any other
key gets its default, named in one warning (a required key has none: an error). An unknown key
is an error naming it with the closest valid key; a DeepSpeed key listed as *accepted, not
built* loads, and is named in one warning (with what differs from DeepSpeed) only when its value
would make DeepSpeed train differently: off values and keys that tune only speed, memory layout
or logging are not named. The features DeepSpeed 0.19.8 removed are errors naming the key, in
DeepSpeed's words, as DeepSpeed refuses them: {removed}. A validated config is read-only:
`config.updated({{...}})` gives a changed copy, checked again.
"""

_DEFAULT_ONLY_NOTE = (
    " *Acted on only at its default: another value loads and, where it changes training, is "
    "named in the not-built warning.*"
)
_SCALARS = {int: "integer", float: "number", bool: "boolean", str: "string", type(None): "null"}
_BOUNDS = (
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Ge, "ge", ">="),
    (annotated_types.Lt, "lt", "<"),
    (annotated_types.Le, "le", "<="),
)


@dataclass(frozen=True)
class SectionDoc:
    """One table of the page: a section's JSON path, its model, and what picks it (a
    discriminated union's ``type``)."""

    path: str
    model: type[Section]
    picked_by: str = ""


def section_docs(
    model: type[Section] = ZeroOffloadConfig, path: str = "", picked_by: str = ""
) -> Iterator[SectionDoc]:
    """Every section reachable from ``model``, depth first in field order; each member of a
    union of sections (the scheduler types) as a section of its own."""
    yield SectionDoc(path, model, picked_by)
    for name, field in model.model_fields.items():
        members = sections_in(field.annotation)
        for member in members:
            tag = _union_tag(member) if len(members) > 1 else picked_by
            child = f"{path}.{name}" if path else name
            yield from section_docs(member, child, tag)


def _union_tag(model: type[Section]) -> str:
    """``"type": "WarmupLR"`` for a union member told apart by its Literal ``type`` (or, for
    a member without one, such as the optimizer's params, its ``PICKED_BY``)."""
    if "type" not in model.model_fields:
        return str(getattr(model, "PICKED_BY", ""))
    values = typing.get_args(model.model_fields["type"].annotation)
    return f'"type": {json.dumps(values[0])}'


def type_text(annotation: Any) -> str:
    """An annotation in JSON's words: ``integer or null``, ``"mean" or "sum"``, ``object``."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        inner, *extra = typing.get_args(annotation)
        bounds = [b for e in extra if isinstance(e, FieldInfo) for b in _bounds(e.metadata)]
        return _bounded(type_text(inner), bounds)
    if origin is Union or origin is types.UnionType:
        parts = [type_text(arg) for arg in typing.get_args(annotation)]
        return " or ".join(dict.fromkeys(parts))  # a union of sections is one "object"
    if origin is Literal:
        return " or ".join(json.dumps(v) for v in typing.get_args(annotation))
    if origin is list:
        return f"list of {type_text(typing.get_args(annotation)[0])}"
    if origin is tuple:
        return "[" + ", ".join(type_text(a) for a in typing.get_args(annotation)) + "]"
    if isinstance(annotation, type) and issubclass(annotation, Section):
        return "object"
    return _SCALARS.get(annotation, getattr(annotation, "__name__", str(annotation)))


def field_type_text(field: FieldInfo) -> str:
    """The field's type with its bounds on the value (not on a null alternative)."""
    bounds = _bounds(field.metadata)
    args = typing.get_args(field.annotation)
    origin = typing.get_origin(field.annotation)
    if (origin is Union or origin is types.UnionType) and type(None) in args:
        value = [a for a in args if a is not type(None)]
        inner = value[0] if len(value) == 1 else Union[tuple(value)]  # noqa: UP007
        return f"{_bounded(type_text(inner), bounds)} or null"
    return _bounded(type_text(field.annotation), bounds)


def _bounded(text: str, bounds: list[str]) -> str:
    return f"{text} {', '.join(bounds)}" if bounds else text


def _bounds(metadata: list[Any]) -> list[str]:
    out = []
    for kind, attr, symbol in _BOUNDS:
        out.extend(f"{symbol} {_number(getattr(m, attr))}" for m in metadata if isinstance(m, kind))
    return out


def _number(value: Any) -> str:
    return json.dumps(int(value) if isinstance(value, float) and value.is_integer() else value)


def default_text(field: FieldInfo) -> str:
    """The default as JSON; ``required`` when there is none, ``{}`` for a section (each of its
    keys at its own default)."""
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, Section):
        return "`{}`"
    return f"`{json.dumps(value)}`"


def _key_text(doc: SectionDoc, name: str, field: FieldInfo) -> str:
    key = f"`{doc.path}.{name}`" if doc.path else f"`{name}`"
    others = ALIASES.get(doc.model, {}).get(name, ())
    return key + "".join(f"<br>also `{other}`" for other in others)


def _row(doc: SectionDoc, name: str, field: FieldInfo) -> str:
    extra = field.json_schema_extra
    note = _DEFAULT_ONLY_NOTE if isinstance(extra, dict) and extra.get("default_only") else ""
    kind = field_type_text(field)
    cells = [_key_text(doc, name, field), kind, default_text(field), f"{field.description}{note}"]
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def _prose(text: str | None) -> str:
    """A class docstring as one Markdown paragraph (reST's roles and double backquotes made
    Markdown code)."""
    text = re.sub(r":[a-z]+:`", "`", " ".join((text or "").split()))  # :attr:`x` -> `x`
    return text.replace("``", "`")


def section_text(doc: SectionDoc) -> str:
    """One section: heading, the model's docstring, the key table, what is accepted unbuilt."""
    title = f"`{doc.path}`" if doc.path else "Top level"
    if doc.picked_by:
        title += f" with `{doc.picked_by}`"
    intro = _prose(doc.model.__doc__)
    lines = [f"## {title}", "", *([intro, ""] if intro else [])]
    lines += ["| Key | Type | Default | Description |", "| --- | --- | --- | --- |"]
    lines += [_row(doc, name, f) for name, f in doc.model.model_fields.items()]
    unbuilt = sorted(doc.model.NOT_IMPLEMENTED)
    if unbuilt:
        keys = ", ".join(f"`{k}`" for k in unbuilt)
        lines += ["", f"Accepted, not built (named in the not-built warning when on): {keys}."]
    for key, hint in sorted(doc.model.KEY_HINTS.items()):
        lines += ["", f"`{key}` is refused: {hint}."]
    return "\n".join(lines) + "\n"


def render() -> str:
    """The whole of ``docs/config.md``."""
    removed = ", ".join(
        [f"`{k}`" for k in sorted(REMOVED_TOP_LEVEL)]
        + [f"`zero_optimization.{k}`" for k in sorted(REMOVED_ZERO)]
        + ["the optimizers " + ", ".join(f"`{n}`" for n in REMOVED_OPTIMIZERS)]
    )
    header = HEADER.format(removed=removed)
    return "\n".join([header, *(section_text(doc) for doc in section_docs())])
