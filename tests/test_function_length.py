"""No function in src/ is longer than ``LIMIT`` lines (docstring included), except those listed
in ``KNOWN``, which are waiting to be split; the list may only shrink."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "zero_offload"
LIMIT = 60

# "module:qualified name" of each function allowed over the limit (none: keep it that way)
KNOWN: frozenset[str] = frozenset()


def _visit(node: ast.AST, prefix: str, out: dict[str, int]) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            name = f"{prefix}{child.name}"
            length = child.end_lineno - child.lineno + 1
            if not isinstance(child, ast.ClassDef) and length > LIMIT:
                out[name] = length
            _visit(child, name + ".", out)


def _long_functions() -> dict[str, int]:
    out: dict[str, int] = {}
    for path in sorted(SRC.rglob("*.py")):
        module = ".".join(path.relative_to(SRC.parent).with_suffix("").parts)
        _visit(ast.parse(path.read_text()), f"{module}:", out)
    return out


def test_no_new_long_function():
    new = {k: v for k, v in _long_functions().items() if k not in KNOWN}
    assert not new, f"functions over {LIMIT} lines (split them): {new}"


def test_known_list_is_current():
    """A split function leaves the list, so it cannot grow back unnoticed."""
    assert not (KNOWN - set(_long_functions())), KNOWN - set(_long_functions())
