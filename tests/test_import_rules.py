"""The package's layering (docs/architecture.md, "Who may import what"), checked on the source.

Every import is resolved to its absolute module, including imports inside functions: a lazy
import is still an arrow. A rule names the importing folder and the folders it may not reach.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "src" / "zero_offload"

# importing folder -> folders it must not import (dotted, relative to zero_offload)
FORBIDDEN = {
    "core": ("runtime", "nvme", "checkpoint", "utils", "hf", "zero", "cli", "api", "config"),
    "nvme": ("runtime", "checkpoint", "utils", "hf"),
    "checkpoint": ("runtime", "hf", "utils"),
    "utils": ("runtime",),
    "runtime.reduce": ("runtime.engine", "runtime.stage3", "runtime.update"),
    "runtime.stage3": ("runtime.engine", "runtime.update"),
    "runtime.update": ("runtime.engine", "runtime.stage3"),
    # loss scaling and overflow read gradient shards only
    "runtime.precision": ("runtime.engine", "runtime.stage3", "runtime.update", "runtime.plan"),
    # an update path knows its own placement, not the group around it or another placement
    "runtime.update.paths": (
        "runtime.update.group",
        "runtime.update.group_step",
        "runtime.offload_states",
        "runtime.update.muon.muon_groups",
        "runtime.update.zenflow",
    ),
    # ZenFlow is one update path (on the host one); the assembly builds it
    "runtime.update.zenflow": (
        "runtime.engine",
        "runtime.update.group",
        "runtime.update.group_step",
        "runtime.offload_states",
    ),
    # the memory estimator reads reduce/'s and update/'s sizes; the engine imports it
    "runtime.plan": ("runtime.engine", "runtime.stage3"),
    # the swap-file layer does not know what a file holds
    "nvme.io": (
        "nvme.optimizer_state",
        "nvme.param_shard",
        "nvme.param_cache",
        "nvme.state_range",
        "nvme.preflight",
        "nvme.reclaim",
    ),
    # reading a checkpoint needs nothing of writing or exporting one
    "checkpoint.read": ("checkpoint.write", "checkpoint.export"),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(module: str, is_package: bool, source: str) -> list[tuple[int, str, list[str]]]:
    """(line, absolute module, imported names) for every ``import`` / ``from`` in the source."""
    package = module if is_package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append((node.lineno, target, [a.name for a in node.names]))
    return out


def _within(module: str, folder: str) -> bool:
    full = f"zero_offload.{folder}"
    return module == full or module.startswith(full + ".")


def _top(module: str) -> str:
    """The top-level folder (or module) of zero_offload that ``module`` belongs to."""
    parts = module.split(".")
    return parts[1] if parts[0] == "zero_offload" and len(parts) > 1 else parts[0]


# (importing folder, imported module) arrows allowed despite FORBIDDEN
ALLOWED = {
    # the optional-dependency loader imports nothing of the package
    ("checkpoint", "hf.deps"),
}


def _violations(module: str, is_package: bool, source: str) -> list[str]:
    found = []
    for line, target, names in _imports(module, is_package, source):
        reached = [target] + [f"{target}.{n}" for n in names]
        for folder, banned in FORBIDDEN.items():
            if not _within(module, folder):
                continue
            for other in banned:
                if (folder, target.removeprefix("zero_offload.")) in ALLOWED:
                    continue
                if any(_within(r, other) for r in reached):
                    found.append(f"{module}:{line} imports {target} ({folder} -> {other})")
        # a private name is private to its top-level folder
        private = [n for n in names if n.startswith("_") and not n.startswith("__")]
        if private and target.startswith("zero_offload") and _top(target) != _top(module):
            found.append(f"{module}:{line} imports private {private} from {target}")
    return found


def test_no_import_runs_back_up():
    found = []
    for path in sorted(PKG.rglob("*.py")):
        found += _violations(_module_name(path), path.name == "__init__.py", path.read_text())
    assert found == []


@pytest.mark.parametrize(
    "source, expected",
    [
        ("from ..runtime.plan import memory\n", "core -> runtime"),
        ("from ..hf.export import _helper\n", "imports private"),
    ],
)
def test_rules_catch_a_bad_import(source, expected):
    """The checker itself: a bad import in a module of core/ is reported."""
    found = _violations("zero_offload.core.planted", False, source)
    assert any(expected in v for v in found), found


def _room(module: str) -> str | None:
    """The room of runtime/ a module lives in: its folder, or runtime itself for its files."""
    parts = module.split(".")
    if len(parts) < 3 or parts[:2] != ["zero_offload", "runtime"]:
        return None
    return parts[2] if (PKG / "runtime" / parts[2]).is_dir() else "runtime"


def room_arrows() -> dict[str, set[str]]:
    arrows: dict[str, set[str]] = {}
    for path in sorted(PKG.rglob("*.py")):
        module = _module_name(path)
        here = _room(module)
        if here is None:
            continue
        for _, target, names in _imports(module, path.name == "__init__.py", path.read_text()):
            for reached in [target] + [f"{target}.{n}" for n in names]:
                there = _room(reached)
                if there is not None and there != here:
                    arrows.setdefault(here, set()).add(there)
    return arrows


def test_no_import_circle_among_runtime_rooms():
    """Every arrow between runtime/'s rooms (lazy imports too) points one way."""
    arrows = room_arrows()

    def reaches(a: str, b: str, seen: frozenset = frozenset()) -> bool:
        return any(
            n == b or (n not in seen and reaches(n, b, seen | {n})) for n in arrows.get(a, ())
        )

    circles = sorted((a, b) for a in arrows for b in arrows[a] if reaches(b, a))
    assert circles == [], circles


# Inside runtime/, only these read the config: the assembly, and DeepSpeed's accessors that
# report it. Everything else receives typed policies or plain values.
CONFIG_READERS = {
    "engine/assembly.py",
    "engine/deepspeed_api/engine_api.py",
    "engine/deepspeed_api/engine_compat.py",
}


def _keeps_config(node: ast.AST) -> bool:
    """``self.config = parts.config``: the engine keeping the assembled config for its readers."""
    return isinstance(node, ast.Assign) and ast.unparse(node) == "self.config = parts.config"


def test_only_the_assembly_and_accessors_read_the_config():
    readers = []
    for path in sorted((PKG / "runtime").rglob("*.py")):
        rel = path.relative_to(PKG / "runtime").as_posix()
        tree = ast.parse(path.read_text())
        kept = {id(n) for a in ast.walk(tree) if _keeps_config(a) for n in ast.walk(a)}
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "config"
                and rel not in CONFIG_READERS
                and id(node) not in kept
            ):
                readers.append(f"runtime/{rel}:{node.lineno}")
    assert readers == []


def test_standalone_scripts_import_only_each_other():
    """checkpoint/scripts/ is copied beside every checkpoint and run without the package."""
    found = []
    for path in sorted((PKG / "checkpoint" / "scripts").rglob("*.py")):
        module = _module_name(path)
        for line, target, _ in _imports(module, path.name == "__init__.py", path.read_text()):
            if target.startswith("zero_offload") and not _within(target, "checkpoint.scripts"):
                found.append(f"{module}:{line} imports {target}")
    assert found == []


MAX_FILES = 12
# Folders still over the limit, to be split by concept; this set only shrinks.
OVER_LIMIT: set[str] = set()


def test_no_folder_over_twelve_files():
    """A room says one thing: no folder of src/ holds more than 12 Python files."""
    crowded = {}
    for folder in [PKG, *(p for p in PKG.rglob("*") if p.is_dir())]:
        count = len(list(folder.glob("*.py")))
        rel = folder.relative_to(PKG).as_posix()
        if count > MAX_FILES and rel not in OVER_LIMIT:
            crowded[rel] = count
    assert crowded == {}
