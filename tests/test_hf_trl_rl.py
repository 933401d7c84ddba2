"""TRL's trainers that build a second engine (``prepare_deepspeed``: dotted top-level config keys)
or generate under ZeRO-3 (``unwrap_model_for_generation``: ``optimizer.parameter_offload``), at
stage 3 with optimizer and param offload, against the same script without DeepSpeed: GRPO with a
KL term (generation and a reference model) and DPO with its reference model. Script:
``tests/hf_route/run_trl_rl.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
from hf_route_helpers import assert_close_losses, ds_config, run_script, tiny_llama_dir

pytest.importorskip("trl")
pytest.importorskip("datasets")

COMMON = {
    "max_steps": 2,
    "logging_steps": 1,
    "learning_rate": 1e-2,
    "weight_decay": 0.0,
    "seed": 0,
    "data_seed": 0,
    "save_strategy": "no",
    "bf16": False,
    "gradient_accumulation_steps": 1,
}


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf_trl_rl")


@pytest.fixture(scope="module")
def model_dir(work) -> str:
    return str(tiny_llama_dir(work / "llama"))


def _pair(work, model_dir, trainer: str, args: dict) -> tuple[dict, dict]:
    ds = ds_config(3, offload=True, offload_param=True)
    runs = []
    for name, config in (("z", ds), ("p", None)):
        spec = {
            "trainer": trainer,
            "opt_in": "call" if config else "none",
            "model_dir": model_dir,
            "ds": config,
            "args": {**COMMON, **args, "output_dir": str(work / f"{trainer}_{name}")},
        }
        runs.append(run_script("run_trl_rl.py", spec, work))
    return runs[0], runs[1]


def _assert_second_engine(got: dict) -> None:
    assert got["engine"] == "ZeroOffloadEngine" and got["partitioned"]
    assert got["ref_engine"] == "ZeroOffloadEngine" and got["ref_partitioned"]
    # prepare_deepspeed's "zero_optimization.stage3_param_persistence_threshold" (10 * hidden)
    # was applied: the 32-element norms stay gathered (the Trainer's config says 0)
    assert got["ref_persistent"] == [32]


def test_grpo_stage3_both_offloads_matches_plain(work, model_dir):
    args = {
        "per_device_train_batch_size": 4,
        "num_generations": 2,
        "max_completion_length": 6,
        "beta": 0.1,
    }
    got, ref = _pair(work, model_dir, "grpo", args)
    _assert_second_engine(got)
    assert got["hooks_unwrapped"]  # generation went through TRL's hook removal
    assert got["rewards"] == ref["rewards"]  # the same completions were generated
    # GRPO's first loss is ~0 (advantages average to zero): relative, plus float32 rounding
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-4, abs=1e-6)


def test_dpo_reference_model_stage3_matches_plain(work, model_dir):
    args = {"per_device_train_batch_size": 2, "max_length": 64}
    got, ref = _pair(work, model_dir, "dpo", args)
    _assert_second_engine(got)
    assert_close_losses(got["losses"], ref["losses"], 1e-4)
