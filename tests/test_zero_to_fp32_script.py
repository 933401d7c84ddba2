"""``zero_to_fp32.py`` in every checkpoint folder: standalone (torch and safetensors only), with
DeepSpeed 0.19.8's arguments, its output equal to ``get_fp32_state_dict_from_zero_checkpoint``;
and ``convert_zero_checkpoint_to_fp32_state_dict`` with DeepSpeed 0.19.8's signature."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import build, train
from distributed import run_ranks
from safetensors.torch import load_file

from zero_offload.checkpoint import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
)

CASES = {
    "stage0": {"id": "s0", "tied": True, "stage": 0, "offload": False, "dtype": "fp32"},
    "stage3": {"id": "s3", "tied": True, "stage": 3, "offload": True, "dtype": "bf16"},
}


def _save(case: dict, root: str) -> None:
    engine, _ = build(case)
    train(engine, case, 0, 2)
    engine.save_checkpoint(root)
    engine.destroy()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """Stage 3 with param offload, bf16, one rank: a tied weight, a frozen param, an int buffer."""
    root = tmp_path_factory.mktemp("stage3")
    _save({**CASES["stage3"], "micro": 2, "gas": 1}, str(root))
    return root


def _run_script(saved: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    """The copied script in a bare interpreter: zero_offload cannot be imported there."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env["PYTHONNOUSERSITE"] = "1"
    code = (
        "import sys; sys.modules['zero_offload'] = None; import runpy; "
        f"sys.argv = {[str(saved / 'zero_to_fp32.py'), str(saved), str(out), *args]!r}; "
        f"runpy.run_path({str(saved / 'zero_to_fp32.py')!r}, run_name='__main__')"
    )
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )


def _assert_equal(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)  # safetensors files list their keys sorted
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


def test_every_save_has_the_script_beside_latest(saved):
    script = saved / "zero_to_fp32.py"
    assert (saved / "latest").is_file() and script.is_file() and os.access(script, os.X_OK)
    text = script.read_text()
    assert "zero_offload" not in "".join(
        ln for ln in text.splitlines() if ln.startswith(("import", "from"))
    )


@pytest.mark.parametrize(
    "case, safe",
    [
        ("stage3", True),
        ("stage0", False),
        pytest.param("stage2_two_ranks", False, marks=pytest.mark.slow),
    ],
)
def test_script_output_equals_the_library_export(case, safe, saved, tmp_path):
    """Sharded at one rank (stage 3), unsharded (stage 0: rank 0 holds the whole flat buffer),
    sharded over two ranks (stage 2)."""
    if case == "stage3":
        pass
    elif case == "stage0":
        saved = tmp_path / "ckpt"
        _save({**CASES["stage0"], "micro": 2, "gas": 1}, str(saved))
    else:
        saved = tmp_path / "ckpt"
        two = {"id": "s2", "tied": True, "stage": 2, "offload": False, "dtype": "fp32"}
        run_ranks(2, _save, {**two, "micro": 1, "gas": 2}, str(saved))
    want = get_fp32_state_dict_from_zero_checkpoint(saved)
    flags = ["--safe_serialization"] if safe else []
    proc = _run_script(saved, tmp_path / "out", *flags)
    assert proc.returncode == 0, proc.stderr
    path = tmp_path / "out" / ("model.safetensors" if safe else "pytorch_model.bin")
    got = load_file(path) if safe else torch.load(path, weights_only=True)
    _assert_equal(got, want)


def test_script_shards_with_an_index_and_takes_a_tag(saved, tmp_path):
    tag = (saved / "latest").read_text()
    proc = _run_script(saved, tmp_path, "-t", tag, "--max_shard_size", "2KB")
    assert proc.returncode == 0, proc.stderr
    index = json.loads((tmp_path / "pytorch_model.bin.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0].startswith("pytorch_model-00001-of-")
    got: dict = {}
    for f in files:
        got.update(torch.load(tmp_path / f, weights_only=True))
    want = get_fp32_state_dict_from_zero_checkpoint(saved)
    _assert_equal({k: got[k] for k in want}, want)


def test_script_excludes_frozen_parameters(saved, tmp_path):
    proc = _run_script(saved, tmp_path, "--exclude_frozen_parameters", "--safe_serialization")
    assert proc.returncode == 0, proc.stderr
    want = get_fp32_state_dict_from_zero_checkpoint(saved, exclude_frozen_parameters=True)
    _assert_equal(load_file(tmp_path / "model.safetensors"), want)


def test_script_refuses_a_damaged_file(saved, tmp_path):
    import shutil

    copy = tmp_path / "ckpt"
    shutil.copytree(saved, copy)
    tag = (copy / "latest").read_text()
    f = copy / tag / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    proc = _run_script(copy, tmp_path / "out")
    assert proc.returncode != 0 and "checksum mismatch" in proc.stderr


def test_convert_takes_deepspeeds_signature(saved, tmp_path):
    """checkpoint_dir, output_dir, max_shard_size="5GB", safe_serialization=False, tag=None,
    exclude_frozen_parameters=False: a positional "5GB" is the shard size, not the tag."""
    files = convert_zero_checkpoint_to_fp32_state_dict(saved, tmp_path / "a", "5GB")
    assert [f.name for f in files] == ["pytorch_model.bin"]
    want = get_fp32_state_dict_from_zero_checkpoint(saved)
    _assert_equal(torch.load(files[0], weights_only=True), want)
    files = convert_zero_checkpoint_to_fp32_state_dict(
        saved, tmp_path / "b", "5GB", True, tag=(saved / "latest").read_text()
    )
    _assert_equal(load_file(files[0]), want)
    with pytest.raises(ValueError, match="max_shard_size"):
        convert_zero_checkpoint_to_fp32_state_dict(saved, tmp_path / "c", "five gigs")


def test_ranks_converting_into_one_folder_at_once_all_succeed(saved, tmp_path, monkeypatch):
    """Every rank of a job calling ``convert_zero_checkpoint_to_fp32_state_dict`` into the same
    folder (as DeepSpeed's own scripts do): another writer that finishes while this one is still
    writing must not take this one's file away (one shared temporary name did)."""
    out = tmp_path / "fp32"
    real_replace = os.replace
    nested = []

    def replace_after_another_rank_converted(src, dst, *args, **kwargs):
        if not nested:  # this rank's file is written; the other rank converts before the rename
            nested.append(True)
            convert_zero_checkpoint_to_fp32_state_dict(saved, out)
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace_after_another_rank_converted)
    convert_zero_checkpoint_to_fp32_state_dict(saved, out)
    monkeypatch.undo()
    assert sorted(p.name for p in out.iterdir()) == ["pytorch_model.bin"]  # no leftovers
    _assert_equal(
        torch.load(out / "pytorch_model.bin", weights_only=True),
        get_fp32_state_dict_from_zero_checkpoint(str(saved)),
    )
