"""TRL's ``SFTTrainer`` with ``deepspeed=`` trains on zero_offload through the DeepSpeed opt-in
(a small in-memory ``datasets.Dataset`` of text, TRL's default gradient checkpointing) and its
losses equal the plain ``SFTTrainer``'s. Script: ``tests/hf_route/run_sft.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
from hf_route_helpers import assert_close_losses, ds_config, run_script, tiny_llama_dir

pytest.importorskip("trl")
pytest.importorskip("datasets")


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf_trl")


@pytest.fixture(scope="module")
def model_dir(work) -> str:
    return str(tiny_llama_dir(work / "llama"))


def _args(out: Path, **over) -> dict:
    args = {
        "output_dir": str(out),
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "max_steps": 4,
        "logging_steps": 1,
        "learning_rate": 1e-2,
        "weight_decay": 0.0,
        "bf16": False,
        "seed": 0,
        "data_seed": 0,
        "save_strategy": "no",
        "max_length": 64,
    }
    args.update(over)
    return args


def _sft(work, model_dir, ds, args, **kw):
    spec = {"opt_in": "call" if ds else "none", "model_dir": model_dir, "ds": ds, "args": args}
    return run_script("run_sft.py", spec, work, **kw)


def test_sft_trainer_stage3_offload_matches_plain(work, model_dir):
    got = _sft(work, model_dir, ds_config(3, offload=True, offload_param=True), _args(work / "z"))
    ref = _sft(work, model_dir, None, _args(work / "p"))
    assert got["engine"] == "ZeroOffloadEngine" and got["gradient_checkpointing"]
    assert got["partitioned_after_load"]
    assert_close_losses(got["losses"], ref["losses"], 1e-4)


@pytest.mark.slow
def test_sft_trainer_two_ranks_and_trl_defaults(work, model_dir):
    got = _sft(
        work,
        model_dir,
        ds_config(2, offload=True),
        _args(work / "z2"),
        nproc=2,
        launcher="torchrun",
    )
    ref = _sft(work, model_dir, None, _args(work / "p2", per_device_train_batch_size=4))
    assert got["world_size"] == 2
    assert_close_losses(got["losses"], ref["losses"], 1e-4)
    # TRL's own defaults: bf16 (the CPU stands in for a bf16 GPU: the spec asks for it)
    got = _sft(
        work, model_dir, ds_config(3, offload=True), _args(work / "zb", bf16=None, cpu_bf16=True)
    )
    ref = _sft(work, model_dir, None, _args(work / "pb", bf16=None, use_cpu=True))
    assert got["bf16"] and ref["bf16"]
    assert_close_losses(got["losses"], ref["losses"], 2e-2)
