"""Accelerate on zero_offload through the DeepSpeed opt-in: an ``Accelerator`` with a
``DeepSpeedPlugin`` (prepare, backward, step) in one process, and ``accelerate launch
--use_deepspeed --zero_stage 3 --offload_optimizer_device cpu --offload_param_device cpu`` with
two CPU processes; per-micro-step losses equal the plain Accelerate loop's (fp32, 1e-4), and
``save_state``/``load_state`` bring back the weights and the optimizer state.
Scripts: ``tests/hf_route/run_accelerate.py``, run in subprocesses."""

from __future__ import annotations

from pathlib import Path

import pytest
from hf_route_helpers import assert_close_losses, ds_config, run_script, tiny_llama_dir

ENGINE = "zero_offload.runtime.engine.engine.ZeroOffloadEngine"
BASE = {"steps": 4, "micro": 2, "gas": 2}


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf_accelerate")


@pytest.fixture(scope="module")
def model_dir(work) -> str:
    return str(tiny_llama_dir(work / "llama"))


def _plain(work, model_dir, micro: int) -> list[float]:
    spec = {**BASE, "micro": micro, "opt_in": "none", "model_dir": model_dir, "plugin": None}
    return run_script("run_accelerate.py", spec, work)["losses"]


def test_accelerator_with_a_deepspeed_plugin(work, model_dir):
    """The plugin from code, the torch optimizer mapped to DeepSpeedCPUAdam (optimizer
    offload); and a config file with an optimizer block (accelerate's DummyOptim)."""
    plugin = {"zero_stage": 2, "offload_optimizer_device": "cpu", "gradient_accumulation_steps": 2}
    got = run_script(
        "run_accelerate.py",
        {**BASE, "opt_in": "call", "model_dir": model_dir, "plugin": plugin},
        work,
    )
    assert got["engine"] == ENGINE and got["distributed_type"] == "DistributedType.DEEPSPEED"
    ref = _plain(work, model_dir, 2)
    assert_close_losses(got["losses"], ref, 1e-4)
    cfg = ds_config(1, optimizer_block=True) | {"gradient_clipping": 1.0}
    cfg["optimizer"]["params"] = {"lr": "auto", "weight_decay": "auto"}
    plugin = {"hf_ds_config": cfg, "gradient_accumulation_steps": 2}
    got = run_script(
        "run_accelerate.py",
        {**BASE, "opt_in": "call", "model_dir": model_dir, "plugin": plugin},
        work,
    )
    assert got["engine"] == ENGINE
    assert_close_losses(got["losses"], ref, 1e-4)


def test_accelerate_launch_zero3_offload_two_processes(work, model_dir):
    flags = [
        "--use_deepspeed",
        "--zero_stage",
        "3",
        "--offload_optimizer_device",
        "cpu",
        "--offload_param_device",
        "cpu",
        "--gradient_accumulation_steps",
        "2",
        "--mixed_precision",
        "no",
    ]
    spec = {**BASE, "opt_in": "env", "model_dir": model_dir, "threshold0": True}
    spec["save_state"] = str(work / "accelerate_state")
    got = run_script(
        "run_accelerate.py",
        spec,
        work,
        nproc=2,
        launcher="accelerate",
        opt_in_env=True,
        extra_launch=flags,
    )
    assert got["engine"] == ENGINE and got["num_processes"] == 2
    assert got["partitioned_after_load"] and got["partitioned_after_prepare"]
    assert_close_losses(got["losses"], _plain(work, model_dir, 4), 1e-4)
    # save_state / load_state: the partitioned weights and the offloaded optimizer state return
    trip = got["state_roundtrip"]
    before, moved, after = trip["probe"]
    assert after == before and moved != before, trip["probe"]
    assert trip["again"] == trip["first"], trip
    assert (work / "accelerate_state").is_dir()
