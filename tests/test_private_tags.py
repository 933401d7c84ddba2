"""Private tags the package puts on objects it does not own (params, modules, functions) stay in
one folder (docs/architecture.md, "What may read a param's shard").

No import rule sees a tag: ``p._z3_slot`` read in checkpoint/ couples it to stage 3 as much as an
import would. So every tag name (``_z3_*``, ``_zero_offload``) is found wherever it is spelled,
as an attribute (``p._z3_slot``) or as a string (``getattr(p, "_z3_slot")``,
``m.__dict__["_z3_external"]``), in src/ and in tests/; each must be spelled in one folder only.
A param's partition tags are core/partitioned.py's: every other folder asks it
(``partitioned.init_shard``, ``slot_of``, ``store_of``, ``engine_link``, ``is_leaf_module``, ...).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "zero_offload"

# the partition's tags and the one file that reads and writes them
PARTITION_TAGS = {"_z3_init", "_z3_slot", "_z3_store", "_zero_offload", "_z3_leaf", "_z3_external"}
OWNER = "src/zero_offload/core/partitioned.py"


def _is_tag(name: str) -> bool:
    return name.startswith("_z3_") or name == "_zero_offload"


def _tags(source: str) -> list[tuple[int, str]]:
    """(line, tag) for every tag spelled as an attribute or as a whole string constant."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _is_tag(node.attr):
            found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _is_tag(node.value):
            found.append((node.lineno, node.value))
    return found


def _sources() -> list[Path]:
    """src/ and tests/, less this file (it spells the tags to look for them)."""
    found = [*PKG.rglob("*.py"), *(ROOT / "tests").rglob("*.py")]
    return sorted(p for p in found if p != Path(__file__).resolve())


def _spread(files: dict[str, str]) -> dict[str, dict[str, list[str]]]:
    """tag -> folder -> the ``file:line`` places that spell it."""
    where: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for rel, source in files.items():
        folder = rel.rpartition("/")[0]
        for line, tag in _tags(source):
            where[tag][folder].append(f"{rel}:{line}")
    return where


def _read_all() -> dict[str, str]:
    return {p.relative_to(ROOT).as_posix(): p.read_text() for p in _sources()}


def test_each_tag_is_spelled_in_one_folder():
    spread = {t: dict(f) for t, f in _spread(_read_all()).items() if len(f) > 1}
    assert spread == {}


def test_partition_tags_are_the_owners_alone():
    where = _spread(_read_all())
    outside = {
        t: places
        for t in PARTITION_TAGS
        for places in [[p for ps in where.get(t, {}).values() for p in ps]]
        if any(not p.startswith(OWNER + ":") for p in places)
    }
    assert outside == {}
    assert PARTITION_TAGS <= set(where)  # the owner still spells each (the names did not drift)


def test_the_check_catches_a_tag_read_elsewhere():
    """The checker itself: a tag read in a second folder, by attribute or by string, is found."""
    files = {
        OWNER: 'def slot_of(p):\n    return getattr(p, "_z3_slot", None)\n',
        "src/zero_offload/checkpoint/planted.py": "def f(p):\n    return p._z3_slot\n",
        "src/zero_offload/hf/planted.py": 'def g(m):\n    return m.__dict__.get("_z3_external")\n',
    }
    where = _spread(files)
    assert set(where["_z3_slot"]) == {"src/zero_offload/core", "src/zero_offload/checkpoint"}
    assert list(where["_z3_external"]) == ["src/zero_offload/hf"]
