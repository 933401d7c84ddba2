"""``Trainer(torch_compile=True)`` with DeepSpeed: accelerate calls DeepSpeed's
``engine.compile(backend=..., compile_kwargs=...)`` after ``deepspeed.initialize``. On
zero_offload through the opt-in (stage 2 with optimizer offload, as in the report), the engine
is compiled and every logged loss, gradient norm and the trained params equal the same compiled
Trainer run without DeepSpeed. The backend is ``aot_eager`` (the wiring is the point: inductor's
code generation would only add minutes of compiling on a CPU). Slow (scripts/test_slow.sh):
``tests/test_engine_compile.py`` checks accelerate's exact call in the default suite."""

from __future__ import annotations

from pathlib import Path

import pytest
from hf_route_helpers import assert_same_training, ds_config, run_script, tiny_llama_dir, train_args

FP32 = 1e-4
COMPILE = {"torch_compile": True, "torch_compile_backend": "aot_eager"}


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf_compile")


@pytest.mark.slow  # two Trainer processes compiling a Llama: the engine-level tests cover the call
def test_compiled_trainer_at_stage2_offload_matches_the_plain_compiled_trainer(work) -> None:
    model_dir = str(tiny_llama_dir(work / "llama"))
    args = train_args(work / "run", max_steps=2, **COMPILE)
    run = {"model_dir": model_dir, "args": args, "final_params": True}
    (plain,) = run_script("run_trainer.py", {"opt_in": "none", "runs": [run]}, work)
    ds_run = {**run, "ds": ds_config(2, offload=True), "args": dict(args)}
    ds_run["args"]["output_dir"] = str(work / "ds")
    (got,) = run_script("run_trainer.py", {"opt_in": "call", "runs": [ds_run]}, work)
    assert got["engine"].endswith("ZeroOffloadEngine")
    assert got["engine_compiled"] is True
    assert_same_training(got, plain, FP32)
