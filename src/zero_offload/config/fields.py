"""JSON scalar types with DeepSpeed's leniency and no more, and the base of every config section.

Pydantic's lax mode would read ``true`` as 1 and ``"8"`` as 8; a config is hand-written, so
those are typos to report, not values to guess. Two leniencies are DeepSpeed's and kept:

* JSON writes ``5e8`` as a float, so an integral float is accepted where an integer belongs.
* The sections DeepSpeed validates with pydantic models in lax mode (``fp16``,
  ``zero_optimization`` and its offload blocks) read a numeric string as the number:
  ``"reduce_bucket_size": "500000000"`` loads there, so it loads here (:data:`DsInt`,
  :data:`DsFloat`). The keys DeepSpeed reads as given (``get_scalar_param``: the batch triple,
  ``gradient_clipping``, ``steps_per_print``) and the optimizer and scheduler params it hands
  on unconverted keep a string as a string, which then fails in DeepSpeed (a TypeError at load
  or at the first step); those stay errors here (:data:`Int`, :data:`Float`).

A converted value passes the same checks as a number given as one (finite, 64-bit range).
"""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, TypeAdapter
from pydantic_core import PydanticCustomError

from .errors import json_repr

# A field marked with this is accepted at any value but acted on only at its default; a
# non-default value lands in the one "not implemented" warning of load_config.
DEFAULT_ONLY = {"default_only": True}


# Every integer of a config reaches torch or C code as a signed 64-bit value at most.
INT64_MAX = 2**63 - 1


def _unquote_hint(value: Any, integral: bool) -> str:
    """For a quoted number this key does not read as one: the fix."""
    if not isinstance(value, str):
        return ""
    try:
        number = float(value)
    except ValueError:
        return ""
    if not math.isfinite(number) or (integral and not number.is_integer()):
        return ""
    return " (a number in quotes: write it without the quotes)"


def _to_int(value: Any) -> int:
    # bool is an int subclass in Python; a JSON true where a count belongs is a typo, not 1.
    if isinstance(value, bool):
        raise ValueError(f"expected an integer, got {json_repr(value)}")
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, int):
        if abs(value) > INT64_MAX:
            raise ValueError(f"{json_repr(value)} is out of range (at most 2**63 - 1)")
        return value
    raise ValueError(f"expected an integer, got {json_repr(value)}{_unquote_hint(value, True)}")


def _to_float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        hint = _unquote_hint(value, False)
        raise ValueError(f"expected a number, got {json_repr(value)}{hint}")
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {value}")
    return float(value)


def _to_bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {json_repr(value)}")
    return value


def _to_str(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {json_repr(value)}")
    return value


Int = Annotated[int, BeforeValidator(_to_int)]
Float = Annotated[float, BeforeValidator(_to_float)]
Bool = Annotated[bool, BeforeValidator(_to_bool)]
Str = Annotated[str, BeforeValidator(_to_str)]

# Pydantic's lax mode, as DeepSpeed's config models run it: " 8 ", "+8", "1_000" and "8.0" are
# integers, "1e-3" and "3" are floats; "5e8" is not an integer (pydantic refuses it).
_LAX_INT = TypeAdapter(int)
_LAX_FLOAT = TypeAdapter(float)


def pydantic_int(text: str) -> int:
    """``text`` as DeepSpeed's pydantic ``int`` field reads it (ValueError if it does not)."""
    return _LAX_INT.validate_python(text)


def pydantic_float(text: str) -> float:
    """``text`` as DeepSpeed's pydantic ``float`` field reads it (ValueError if it does not)."""
    return _LAX_FLOAT.validate_python(text)


def reads_numeric_strings(
    read: Callable[[str], int | float], check: Callable[[Any], Any]
) -> BeforeValidator:
    """A validator that turns a string ``read`` accepts into its number, then applies ``check``
    (the strict conversion and range checks) to the result; a string ``read`` refuses reaches
    ``check`` unchanged and is reported there, naming the key as for any other bad value."""

    def validate(value: Any) -> Any:
        if isinstance(value, str):
            try:
                value = read(value)
            except (ValueError, TypeError, OverflowError):  # pydantic's ValidationError included
                pass
        return check(value)

    return BeforeValidator(validate)


# A number in a section DeepSpeed validates with a pydantic model: also given as a string.
DsInt = Annotated[int, reads_numeric_strings(pydantic_int, _to_int)]
DsFloat = Annotated[float, reads_numeric_strings(pydantic_float, _to_float)]


def to_int(value: Any) -> int:
    """The strict integer conversion of :data:`Int` (for custom numeric-string readers)."""
    return _to_int(value)


def to_float(value: Any) -> float:
    """The strict number conversion of :data:`Float` (for custom numeric-string readers)."""
    return _to_float(value)


def rule_error(key: str, message: str) -> PydanticCustomError:
    """A cross-field rule broken inside a section. ``key`` is the offending key relative to
    the section the validator runs on, so the final message can name the full path."""
    return PydanticCustomError("config_rule", "{msg}", {"key": key, "msg": message})


def sections_in(annotation: Any) -> list[type[Section]]:
    """The Section classes an annotation can hold (through Optional, Union and Annotated)."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return sections_in(typing.get_args(annotation)[0])
    if origin is Union or origin is types.UnionType:
        found: list[type[Section]] = []
        for arg in typing.get_args(annotation):
            found.extend(sections_in(arg))
        return found
    if isinstance(annotation, type) and issubclass(annotation, Section):
        return [annotation]
    return []


class FrozenConfigError(AttributeError):
    """An assignment to a validated config, which is read-only once built."""


class Section(BaseModel):
    """One JSON object of the config. Unknown keys are rejected by the key walker before
    validation (with a suggestion), so ``extra="forbid"`` here only guards direct use.

    Invariant: a section is immutable once validation returns it (fields and private state
    alike), so every holder of a config sees the settings it was validated with. Its own
    after-validators finish it with :meth:`_settle`, before anything else can hold it; a change
    later is a new validated object (:meth:`ZeroOffloadConfig.updated`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # DeepSpeed keys accepted here and ignored; each one present is listed in the warning.
    NOT_IMPLEMENTED: ClassVar[frozenset[str]] = frozenset()
    # Keys that are a known mistake, with what to do instead.
    KEY_HINTS: ClassVar[dict[str, str]] = {}
    # Keys whose value "auto" is DeepSpeed's own setting, not Hugging Face's "fill this in".
    AUTO_IS_A_VALUE: ClassVar[frozenset[str]] = frozenset()

    def __setattr__(self, name: str, value: Any) -> None:
        raise FrozenConfigError(
            f"{type(self).__name__}.{name}: a validated config is read-only; build a changed "
            "copy instead (ZeroOffloadConfig.updated({...}) validates the change)"
        )

    def __delattr__(self, name: str) -> None:
        self.__setattr__(name, None)

    def _settle(self, **values: Any) -> None:
        """Set fields or private attributes from this section's own after-validator: the one
        write a section takes, while validation still holds it (nothing else can see it yet).
        Bypasses the read-only guard, so it must never be called on a returned config."""
        private = self.__pydantic_private__
        for name, value in values.items():
            if private is not None and name in private:
                private[name] = value
            else:
                object.__setattr__(self, name, value)

    @classmethod
    def known_keys(cls) -> set[str]:
        return {f.alias or name for name, f in cls.model_fields.items()}

    @classmethod
    def nested_section(cls, key: str, raw: dict[str, Any]) -> type[Section] | None:
        """The section that validates ``raw[key]``, or None when it is a scalar or cannot be
        told yet (a union decided by a sibling ``type`` overrides this)."""
        field = cls.model_fields.get(key)
        if field is None:
            return None
        found = sections_in(field.annotation)
        return found[0] if len(found) == 1 else None

    def non_default_unimplemented(self, prefix: str = "") -> list[str]:
        """``path=value`` for every DEFAULT_ONLY field set away from its default, recursively."""
        out: list[str] = []
        for name, field in type(self).model_fields.items():
            value = getattr(self, name)
            path = f"{prefix}.{name}" if prefix else name
            extra = field.json_schema_extra
            if isinstance(extra, dict) and extra.get("default_only") and value != field.default:
                out.append(f"{path}={json_repr(value)}")
            if isinstance(value, Section):
                out.extend(value.non_default_unimplemented(path))
        return out
