"""Issue: the standalone ``zero_to_fp32.py`` every save writes converted tampered checkpoints
silently (exit 0, wrong weights): names of two same-shaped params swapped in ``meta.json``, an
``aliases`` entry added, a key dropped from ``model.keys``, a shape recorded transposed, a rank
file rewritten with its digest updated in ``meta.json``, 7 of 40 one-digit edits of ``meta.json``,
a ``latest`` naming another run's folder; a truncated ``meta.json`` or a changed
``layout_world_size`` raised a bare ``JSONDecodeError`` / ``IndexError`` naming no file.

Each case is refused by the script (the copy a save wrote, loaded without the package) with an
error naming the file, and the library's own reader refuses the same case with the same message:
the two share one set of checks."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import reliability_helpers as h
import torch

import zero_offload
from zero_offload.checkpoint import CheckpointError, get_fp32_state_dict_from_zero_checkpoint
from zero_offload.checkpoint.format import sealed_meta_bytes


class TwoSame(torch.nn.Module):
    """Two params of one shape (``a.weight``, ``b.weight``): a swap of their names is silent
    unless something checks."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))).pow(2).mean()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ckpt") / "run"
    torch.manual_seed(0)
    eng, *_ = zero_offload.initialize(model=TwoSame(), config=h.config(2))
    for seed in (1, 2):
        eng.backward(eng(h.batch(seed)))
        eng.step()
    eng.save_checkpoint(str(root))
    eng.destroy()
    return root


def _script(root: Path):
    """The script a save wrote, loaded as its own module (it imports nothing of the package)."""
    name = f"zero_to_fp32_copy_{abs(hash(str(root)))}"
    spec = importlib.util.spec_from_file_location(name, root / "zero_to_fp32.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import does (its dataclasses look themselves up)
    spec.loader.exec_module(module)
    return module


def _copy(saved: Path, tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "run"
    shutil.copytree(saved, root)
    return root, root / (root / "latest").read_text()


def _edit_meta(tag_dir: Path, edit, reseal: bool = False) -> None:
    meta = json.loads((tag_dir / "meta.json").read_text())
    edit(meta)
    if reseal:
        (tag_dir / "meta.json").write_bytes(sealed_meta_bytes(meta))
    else:
        (tag_dir / "meta.json").write_text(json.dumps(meta, indent=1))


def _both_refuse(root: Path, *words: str) -> str:
    """The script and the library refuse ``root`` with one message naming ``words``."""
    with pytest.raises(Exception) as script_err:
        _script(root).get_fp32_state_dict(root)
    with pytest.raises(CheckpointError) as lib_err:
        get_fp32_state_dict_from_zero_checkpoint(root)
    msg = str(script_err.value)
    assert type(script_err.value).__name__ in ("CheckpointError", "CheckpointNotFoundError")
    assert msg == str(lib_err.value)
    for w in words:
        assert w in msg, (w, msg)
    return msg


def _swap_names(meta: dict) -> None:
    names = meta["groups"][0]["names"]
    i, j = names.index("a.weight"), names.index("b.weight")
    names[i], names[j] = names[j], names[i]


def _transpose(meta: dict) -> None:
    shapes = meta["groups"][0]["shapes"]
    i = meta["groups"][0]["names"].index("a.bias")
    meta["groups"][0]["shapes"][i] = [1, shapes[i][0]]  # same numel, another shape


EDITS = {
    "names swapped": _swap_names,
    "alias added": lambda m: m["model"]["aliases"].update({"b.weight": "a.weight"}),
    "key dropped": lambda m: m["model"]["keys"].remove("b.bias"),
    "shape transposed": _transpose,
    "layout_world_size changed": lambda m: m["groups"][0].update(layout_world_size=2),
}


@pytest.mark.parametrize("case", list(EDITS))
def test_edited_meta_is_refused_by_name(case, saved, tmp_path):
    root, tag_dir = _copy(saved, tmp_path)
    _edit_meta(tag_dir, EDITS[case])
    _both_refuse(root, str(tag_dir / "meta.json"), "checksum mismatch")


@pytest.mark.parametrize("case,field", [("names swapped", "names"), ("ws", "layout_world_size")])
def test_resealed_layout_edit_is_refused_by_name(case, field, saved, tmp_path):
    root, tag_dir = _copy(saved, tmp_path)
    edit = EDITS["names swapped"] if case == "names swapped" else EDITS["layout_world_size changed"]
    _edit_meta(tag_dir, edit, reseal=True)
    msg = _both_refuse(root, str(tag_dir / "meta.json"))
    assert f"groups[0].{field}" in msg or "rank files listed" in msg


def test_rank_file_rewritten_with_its_digest_updated(saved, tmp_path):
    root, tag_dir = _copy(saved, tmp_path)
    rank = tag_dir / "rank_00000.safetensors"
    data = bytearray(rank.read_bytes())
    data[-5] ^= 0x01  # a master element changed
    rank.write_bytes(bytes(data))

    def new_digest(meta: dict) -> None:
        entry = meta["files"]["rank_00000.safetensors"]
        bs = entry["block_size"]
        blocks = [hashlib.sha256(data[i : i + bs]).digest() for i in range(0, len(data), bs)]
        entry["block_sha256"] = [b.hex() for b in blocks]
        entry["sha256"] = hashlib.sha256(b"".join(blocks)).hexdigest()

    _edit_meta(tag_dir, new_digest)
    _both_refuse(root, str(tag_dir / "meta.json"), "checksum mismatch")


def test_one_digit_edits_of_meta_are_all_refused(saved, tmp_path):
    root, tag_dir = _copy(saved, tmp_path)
    original = (tag_dir / "meta.json").read_text()
    digits = [i for i, c in enumerate(original) if c.isdigit()]
    rng = random.Random(0)
    script = _script(root)
    named = 0
    for pos in rng.sample(digits, 40):
        other = str((int(original[pos]) + rng.randint(1, 9)) % 10)
        (tag_dir / "meta.json").write_text(original[:pos] + other + original[pos + 1 :])
        try:
            script.get_fp32_state_dict(root)
        except Exception as e:  # before: some converted (wrong weights), some raised bare errors
            named += type(e).__name__ == "CheckpointError" and "meta.json" in str(e)
    assert named == 40


def test_the_written_script_holds_the_librarys_checks(saved):
    """The copy a save writes runs the library's own checks (meta_checks.py, inlined)."""
    from zero_offload.checkpoint.scripts import meta_checks
    from zero_offload.checkpoint.scripts.script_source import recovery_script_source

    written = (saved / "zero_to_fp32.py").read_bytes()
    assert written == recovery_script_source()
    body = (
        Path(meta_checks.__file__).read_text().replace("from __future__ import annotations\n", "")
    )
    assert body in written.decode()
    assert "import zero_offload" not in written.decode() and "from ." not in written.decode()


def test_truncated_meta_is_named(saved, tmp_path):
    root, tag_dir = _copy(saved, tmp_path)
    text = (tag_dir / "meta.json").read_text()
    (tag_dir / "meta.json").write_text(text[: len(text) // 2])
    _both_refuse(root, str(tag_dir / "meta.json"), "not valid JSON")


def test_latest_naming_another_run_is_refused(saved, tmp_path):
    root, tag_dir = _copy(saved, tmp_path)
    other = tmp_path / "other_run"
    shutil.copytree(root, other)
    (root / "latest").write_text(f"../other_run/{tag_dir.name}")
    _both_refuse(root, str(root / "latest"), "one path component")
    with pytest.raises(Exception, match="one path component"):
        _script(root).get_fp32_state_dict(root, tag=f"../other_run/{tag_dir.name}")


def test_the_command_stops_with_one_line(saved, tmp_path):
    root, tag_dir = _copy(saved, tmp_path)
    _edit_meta(tag_dir, EDITS["names swapped"])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = (
        "import sys, runpy; sys.modules['zero_offload'] = None; "
        f"sys.argv = ['zero_to_fp32.py', {str(root)!r}, {str(tmp_path / 'out')!r}]; "
        f"runpy.run_path({str(root / 'zero_to_fp32.py')!r}, run_name='__main__')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"zero_to_fp32.py: error: {tag_dir / 'meta.json'}: checksum mismatch (the metadata was "
        "changed or damaged after it was written: counters, hyperparameters or layout cannot be "
        "trusted)"
    ]
    assert not (tmp_path / "out" / "pytorch_model.bin").exists()


def test_the_shared_checks_import_the_standard_library_only():
    import ast

    from zero_offload.checkpoint.scripts import meta_checks

    tree = ast.parse(Path(meta_checks.__file__).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "meta_checks.py must not import the package"
            names.add(node.module.split(".")[0])
    assert names <= set(sys.stdlib_module_names) | {"__future__"}, names
