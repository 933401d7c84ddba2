"""DeepSpeed's two recovery scripts beside ``latest``: ``zero_to_torch.py`` (DeepSpeed 0.19.8's
arguments, ``--dtype`` required) is written by every save beside ``zero_to_fp32.py`` and gives
that script's weights cast to the dtype (integer buffers keep theirs). And DeepSpeed's OWN
``zero_to_fp32.py`` / ``zero_to_torch.py`` (what a DeepSpeed checkpoint folder holds) run with
``ZERO_OFFLOAD_AS_DEEPSPEED=1`` exported, on a DeepSpeed checkpoint, and write what they write
without the opt-in (the real DeepSpeed): the namespace provides ``deepspeed.checkpoint.constants``
and the classes DeepSpeed's checkpoint files pickle."""

from __future__ import annotations

import importlib.machinery
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import build, train
from safetensors.torch import load_file

from zero_offload.checkpoint import get_fp32_state_dict_from_zero_checkpoint
from zero_offload.checkpoint.scripts import zero_to_torch_script

FIXTURES = Path(__file__).parent / "ds_fixtures"
ENV = "ZERO_OFFLOAD_AS_DEEPSPEED"
CASE = {"id": "s2", "tied": True, "stage": 2, "offload": True, "dtype": "fp32"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ckpt")
    engine, _ = build({**CASE, "micro": 2, "gas": 1})
    train(engine, {**CASE, "micro": 2, "gas": 1}, 0, 2)
    engine.save_checkpoint(str(root))
    engine.destroy()
    return root


def _python(script: Path, *args: str, opt_in: bool = False, cwd: Path | None = None):
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ZERO_OFFLOAD_AS_DEEPSPEED")
    }
    env["DS_ACCELERATOR"] = "cpu"
    if opt_in:
        env[ENV] = "1"
    return subprocess.run(
        [sys.executable, str(script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(cwd) if cwd else None,
    )


def test_every_save_writes_zero_to_torch_beside_zero_to_fp32(saved) -> None:
    for name in ("zero_to_fp32.py", "zero_to_torch.py"):
        assert os.access(saved / name, os.X_OK), name


def test_zero_to_torch_is_zero_to_fp32_cast_to_the_dtype(saved, tmp_path) -> None:
    out = tmp_path / "out"
    proc = _python(saved / "zero_to_torch.py", str(saved), str(out), "--dtype", "bf16",
                   "--safe_serialization", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    got = load_file(out / "model.safetensors")
    want = get_fp32_state_dict_from_zero_checkpoint(saved)
    assert sorted(got) == sorted(want)
    for key, ref in want.items():
        expect = ref.to(torch.bfloat16) if ref.is_floating_point() else ref
        assert got[key].dtype == expect.dtype and torch.equal(got[key], expect), key


def test_zero_to_torch_shards_and_refuses_an_unknown_dtype(saved, tmp_path) -> None:
    files = zero_to_torch_script.convert_zero_checkpoint_to_state_dict(
        saved, tmp_path, dtype="torch.float16", max_shard_size="2KB"
    )
    assert files[-1].name == "pytorch_model.bin.index.json" and len(files) > 2
    got: dict = {}
    for f in files[:-1]:
        got.update(torch.load(f, weights_only=True))
    want = get_fp32_state_dict_from_zero_checkpoint(saved)
    for key, ref in want.items():
        expect = ref.half() if ref.is_floating_point() else ref
        assert torch.equal(got[key], expect), key
    with pytest.raises(ValueError, match="dtype: unsupported output dtype 'int8'; allowed: bf16"):
        zero_to_torch_script.convert_zero_checkpoint_to_state_dict(saved, tmp_path, dtype="int8")
    bad = _python(saved / "zero_to_torch.py", str(saved), str(tmp_path), "--dtype", "int8")
    assert bad.returncode != 0 and "--dtype" in bad.stderr


def _deepspeed_utils() -> Path:
    spec = importlib.machinery.PathFinder.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("deepspeed is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "utils"


_DRIVER = r"""
import runpy, sys
for folder, script, out, *flags in RUNS:
    sys.path.insert(0, folder)
    sys.argv = [script, folder, out, *flags]
    runpy.run_path(f"{folder}/{script}", run_name="__main__")
    sys.path.remove(folder)
"""


def test_deepspeeds_own_scripts_run_under_the_opt_in(tmp_path) -> None:
    """DeepSpeed checkpoint folders as DeepSpeed writes them (its two scripts beside ``latest``),
    stages 2 and 3: each script's output under the opt-in equals the real DeepSpeed's."""
    runs, outs = [], []
    for fixture in ("stage2", "stage3"):
        folder = tmp_path / fixture
        shutil.copytree(FIXTURES / fixture, folder)
        for name in ("zero_to_fp32.py", "zero_to_torch.py"):
            shutil.copy(_deepspeed_utils() / name, folder / name)
        for script, flags in (("zero_to_fp32.py", []), ("zero_to_torch.py", ["--dtype", "bf16"])):
            out = f"{fixture}-{script}"
            runs.append([str(folder), script, out, "--safe_serialization", *flags])
            outs.append(out)
    for opt_in in (True, False):
        code = f"RUNS = {runs!r}\n" + _DRIVER
        cwd = tmp_path / str(opt_in)
        cwd.mkdir()
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", ENV)}
        env.update({"DS_ACCELERATOR": "cpu", **({ENV: "1"} if opt_in else {})})
        proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=str(cwd),
                              capture_output=True, text=True, timeout=600)  # fmt: skip
        assert proc.returncode == 0, (opt_in, proc.stderr[-3000:])
    for out in outs:
        got = load_file(tmp_path / "True" / out / "model.safetensors")
        real = load_file(tmp_path / "False" / out / "model.safetensors")
        assert sorted(got) == sorted(real) and got, out
        for key in real:
            assert torch.equal(got[key], real[key]), (out, key)
