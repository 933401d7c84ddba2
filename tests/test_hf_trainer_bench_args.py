"""benchmarks/hf_trainer.py's command line: ``--sizes`` names the Llama shapes (a shape flag
beside it is an error, not ignored), a named size is timed over at least 5 steps, and the dtype
follows the CPU's bf16 arithmetic."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "hf_trainer.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("hf_trainer_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sizes_pick_the_named_shapes_and_their_defaults(bench, monkeypatch):
    monkeypatch.setattr(bench, "cpu_kind", lambda: ("Some CPU", True))
    a = bench.parse_args(["--sizes", "125M", "350M"])
    assert a.shapes == {"125M": bench.SIZES["125M"], "350M": bench.SIZES["350M"]}
    assert (a.steps - a.warmup) * a.rounds >= bench.MIN_TIMED
    assert a.dtype == "bf16" and a.cpu == "Some CPU"
    monkeypatch.setattr(bench, "cpu_kind", lambda: ("Old CPU", False))
    monkeypatch.setattr(bench, "_cuda", lambda: False)
    assert bench.parse_args(["--sizes", "125M"]).dtype == "fp32"
    assert bench.parse_args(["--sizes", "125M", "--dtype", "bf16"]).dtype == "bf16"
    plain = bench.parse_args([])  # the custom shape keeps its defaults: fp32, 12 steps, 2 rounds
    assert plain.shapes == {"custom": bench.SIZES["tiny"]}
    assert (plain.dtype, plain.steps, plain.rounds) == ("fp32", 12, 2)


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--sizes", "125M", "--hidden", "512"], "--sizes names the model shapes; drop --hidden"),
        (["--sizes", "350M", "--steps", "6", "--warmup", "3"], "at least 5 steps"),
        (["--steps", "3", "--warmup", "3"], "--steps .3. must exceed --warmup"),
        (["--deepspeed-site", "/nonexistent"], "--deepspeed-site /nonexistent: no deepspeed"),
    ],
)
def test_bad_flags_are_refused_by_name(bench, capsys, argv, match):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert re.search(match, capsys.readouterr().err)


def test_tiny_size_may_run_two_steps(bench):
    """The smoke run (tiny, 2 steps, 1 warm-up) is allowed: only real sizes need 5 steps."""
    a = bench.parse_args(["--sizes", "tiny", "--steps", "2", "--warmup", "1"])
    assert (a.steps, a.warmup, a.rounds) == (2, 1, 1)
