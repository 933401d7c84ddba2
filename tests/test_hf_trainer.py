"""Hugging Face ``Trainer`` with ``TrainingArguments(deepspeed=...)`` trains on zero_offload
through the DeepSpeed opt-in, and every logged loss, gradient norm and learning rate equals the
same Trainer run without DeepSpeed (fp32: 1e-4 relative; bf16: 2e-2), and so do the trained
params (fp32): stages 0-3, optimizer offload and (stage 3) param offload, the
optimizer from the config or the Trainer's own, gradient accumulation 2, one process without a
launcher and two ranks under torchrun (CPU, gloo). Stage 3 also: ``from_pretrained`` builds the
model partitioned and loads it right, evaluation during training, ``generate``, ``save_model``,
``save_steps`` checkpoints and ``resume_from_checkpoint=True``.

The scripts run in subprocesses (``tests/hf_route/run_trainer.py``): the opt-in has to happen
before transformers is imported. One subprocess runs many Trainers in turn, to keep the suite
short; the long two-rank sweeps are marked slow (scripts/test_slow.sh)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_route_helpers import (
    assert_close_losses,
    assert_same_training,
    ds_config,
    run_script,
    tiny_llama_dir,
    train_args,
    transformers,
)

FP32, BF16 = 1e-4, 2e-2
EVAL = {"eval_strategy": "steps", "eval_steps": 2, "per_device_eval_batch_size": 2}
ENGINE = "zero_offload.runtime.engine.engine.ZeroOffloadEngine"

# (name, stage, offload_optimizer, offload_param, optimizer block in the config)
MATRIX = [
    ("s0", 0, False, False, False),
    ("s1-config-opt", 1, False, False, True),
    ("s1-offload", 1, True, False, False),
    ("s2-config-opt", 2, False, False, True),
    ("s2-offload", 2, True, False, False),
    ("s3", 3, False, False, False),
    ("s3-offload-both-config-opt", 3, True, True, True),
]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf_trainer")


@pytest.fixture(scope="module")
def model_dir(work) -> str:
    return str(tiny_llama_dir(work / "llama"))


@pytest.fixture(scope="module")
def plain(work, model_dir) -> dict:
    """The same Trainer runs without DeepSpeed."""
    runs = {
        "fp32": {
            "model_dir": model_dir,
            "args": train_args(work / "plain", **EVAL),
            "load_logits": True,
            "generate": True,
            "final_logits": True,
            "final_params": True,
        },
        "bs4": {  # the two-rank runs' global batch in one process
            "model_dir": model_dir,
            "args": train_args(work / "plain4", per_device_train_batch_size=4),
            "final_params": True,
        },
        "bf16": {
            "model_dir": model_dir,
            "args": train_args(work / "plainbf", bf16=True, use_cpu=True),
        },
        "bf16-bs4": {  # the two-rank bf16 runs' global batch in one process
            "model_dir": model_dir,
            "args": train_args(
                work / "plainbf4", bf16=True, use_cpu=True, per_device_train_batch_size=4
            ),  # fmt: skip
        },
        "lora": {"model_dir": model_dir, "args": train_args(work / "plainlora"), "lora": True},
    }
    out = run_script("run_trainer.py", {"opt_in": "none", "runs": list(runs.values())}, work)
    return dict(zip(runs, out))


@pytest.fixture(scope="module")
def one_process(work, model_dir) -> dict:
    """Every one-process scenario with the opt-in, in one subprocess (no launcher)."""
    runs = {}
    for name, stage, off, offp, opt_block in MATRIX:
        runs[name] = {
            "model_dir": model_dir,
            "ds": ds_config(stage, off, offp, optimizer_block=opt_block),
            "args": train_args(work / name),
            "after_train_partitioned": stage == 3,
            "final_params": True,
        }
    runs["s2-offload-bf16"] = {
        "model_dir": model_dir,
        "ds": ds_config(2, offload=True),
        "args": train_args(work / "bf16", bf16=True),
    }
    s3 = ds_config(3, offload=True, offload_param=True, gather_16bit=True)
    runs["s3-features"] = {
        "model_dir": model_dir,
        "ds": s3,
        "args": train_args(work / "features", **EVAL),
        "load_logits": True,
        "generate": True,
        "final_logits": True,
        "save_model": str(work / "saved"),
    }
    runs["s3-lora"] = {
        "model_dir": model_dir,
        "ds": s3,
        "args": train_args(work / "lora"),
        "lora": True,
        "save_model": str(work / "lora-saved"),
    }
    ckpt = train_args(work / "ckpt", save_strategy="steps", save_steps=2)
    runs["s3-interrupted"] = {"model_dir": model_dir, "ds": s3, "args": ckpt, "stop_after": 2}
    runs["s3-resumed"] = {"model_dir": model_dir, "ds": s3, "args": ckpt, "resume": True}
    out = run_script("run_trainer.py", {"opt_in": "call", "runs": list(runs.values())}, work)
    return dict(zip(runs, out))


@pytest.mark.parametrize("name", [m[0] for m in MATRIX])
def test_every_stage_matches_the_plain_trainer(name, one_process, plain):
    got = one_process[name]
    assert got["engine"] == ENGINE
    assert_same_training(got, plain["fp32"], FP32, lr_after_step=name.endswith("config-opt"))
    if name.startswith("s3"):  # every param really was partitioned, before and after training
        assert got["after_load"]["all_partitioned"] and got["after_train"]["all_partitioned"]
    else:
        assert got["after_load"]["ds_numel"] == 0


def test_bf16_matches_the_plain_trainer(one_process, plain):
    assert_same_training(one_process["s2-offload-bf16"], plain["bf16"], BF16)


def test_stage3_from_pretrained_eval_generate_and_save_model(one_process, plain, work):
    got, ref = one_process["s3-features"], plain["fp32"]
    # from_pretrained after stage-3 TrainingArguments: built partitioned, weights loaded right
    assert got["after_load"]["all_partitioned"] and got["after_load"]["ds_numel"] > 0
    torch.testing.assert_close(
        torch.tensor(got["load_logits"]), torch.tensor(ref["load_logits"]), rtol=0, atol=1e-6
    )
    assert_same_training(got, ref, FP32)
    assert len(got["eval_losses"]) == 2
    assert_close_losses(got["eval_losses"], ref["eval_losses"], FP32)
    assert got["generated"] == ref["generated"]
    # save_model gathered the partitioned weights into a folder from_pretrained loads
    saved = transformers.AutoModelForCausalLM.from_pretrained(str(work / "saved")).eval()
    with torch.no_grad():
        logits = saved(input_ids=torch.arange(12).reshape(2, 6) * 7 % 256).logits
    torch.testing.assert_close(logits, torch.tensor(got["final_logits"]), rtol=0, atol=1e-6)
    torch.testing.assert_close(logits, torch.tensor(ref["final_logits"]), rtol=1e-4, atol=1e-4)


def test_stage3_lora_with_peft(one_process, plain, work):
    """peft LoRA adapters on a partitioned model; save_model writes the adapters alone (the
    Trainer asks for the consolidated state dict without the frozen base)."""
    got = one_process["s3-lora"]
    assert_same_training(got, plain["lora"], FP32)
    saved = sorted(p.name for p in (work / "lora-saved").iterdir())
    assert "adapter_model.safetensors" in saved and "model.safetensors" not in saved
    from safetensors.torch import load_file

    adapters = load_file(str(work / "lora-saved" / "adapter_model.safetensors"))
    assert adapters and all("lora_" in k and v.numel() > 0 for k, v in adapters.items())


def test_stage3_checkpoint_resume_matches_the_uninterrupted_run(one_process, plain, work):
    first, resumed = one_process["s3-interrupted"], one_process["s3-resumed"]
    uninterrupted = one_process["s3-features"]  # same config, data, steps and schedule
    assert first["steps"] == [1, 2]
    assert (work / "ckpt" / "checkpoint-2" / "global_step2").is_dir()
    assert resumed["steps"] == [1, 2, 3, 4]  # the first two from the checkpoint's state
    assert_same_training(resumed, uninterrupted, FP32, first=2)
    assert_same_training(resumed, plain["fp32"], FP32, first=2)


def test_two_ranks_under_torchrun_with_the_environment_variable(work, model_dir, plain):
    """An unchanged Trainer script, ZERO_OFFLOAD_AS_DEEPSPEED=1 passed through torchrun: stage 3
    with both offloads and stage 1 in fp32; stage 3 in bf16 interrupted at a save_steps
    checkpoint, then resumed."""
    bf16 = train_args(work / "r2-bf16", bf16=True, save_strategy="steps", save_steps=2)
    s3 = ds_config(3, offload=True)
    runs = [
        {
            "model_dir": model_dir,
            "ds": ds_config(3, offload=True, offload_param=True),
            "args": train_args(work / "r2-s3"),
            "after_train_partitioned": True,
            "final_params": True,
        },
        {
            "model_dir": model_dir,
            "ds": ds_config(1, optimizer_block=True),
            "args": train_args(work / "r2-s1"),
            "final_params": True,
        },
        {"model_dir": model_dir, "ds": s3, "args": bf16, "stop_after": 2},
        {"model_dir": model_dir, "ds": s3, "args": bf16, "resume": True},
    ]
    out = run_script(
        "run_trainer.py",
        {"opt_in": "env", "runs": runs},
        work,
        nproc=2,
        launcher="torchrun",
        opt_in_env=True,
    )
    for got, after in zip(out[:2], (False, True)):  # a wrong 1/world factor: the grad norm
        assert got["world_size"] == 2 and got["engine"] == ENGINE
        assert_same_training(got, plain["bs4"], FP32, lr_after_step=after)
    assert out[0]["after_load"]["all_partitioned"] and out[0]["after_train"]["all_partitioned"]
    first, resumed = out[2:]
    assert first["steps"] == [1, 2] and resumed["steps"] == [1, 2, 3, 4]
    assert (work / "r2-bf16" / "checkpoint-2" / "global_step2").is_dir()
    ref = plain["bf16-bs4"]
    assert_same_training(first, {k: ref[k][:2] for k in ("losses", "grad_norms", "lrs")}, BF16)
    assert_same_training(resumed, ref, BF16, first=2)


@pytest.mark.slow
def test_two_rank_sweep(work, model_dir, plain):
    """Two ranks: every stage and offload mode, bf16, stage-3 evaluation, generate, save_model
    and checkpoint resume."""
    runs = {}
    for name, stage, off, offp, opt_block in MATRIX:
        runs[name] = {
            "model_dir": model_dir,
            "ds": ds_config(stage, off, offp, optimizer_block=opt_block),
            "args": train_args(work / f"sw-{name}"),
        }
    runs["bf16"] = {
        "model_dir": model_dir,
        "ds": ds_config(3, offload=True),
        "args": train_args(work / "sw-bf16", bf16=True),
    }
    s3 = ds_config(3, offload=True, offload_param=True, gather_16bit=True)
    runs["features"] = {
        "model_dir": model_dir,
        "ds": s3,
        "args": train_args(work / "sw-features", **EVAL),
        "load_logits": True,
        "generate": True,
        "final_logits": True,
        "save_model": str(work / "sw-saved"),
    }
    ckpt = train_args(work / "sw-ckpt", save_strategy="steps", save_steps=2)
    runs["interrupted"] = {"model_dir": model_dir, "ds": s3, "args": ckpt, "stop_after": 2}
    runs["resumed"] = {"model_dir": model_dir, "ds": s3, "args": ckpt, "resume": True}
    out = run_script(
        "run_trainer.py", {"opt_in": "call", "runs": list(runs.values())}, work, 2, "torchrun"
    )
    got = dict(zip(runs, out))
    for name, *_, opt_block in MATRIX:
        assert_same_training(got[name], plain["bs4"], FP32, lr_after_step=opt_block)
    plain_bf = run_script(
        "run_trainer.py",
        {
            "opt_in": "none",
            "runs": [
                {
                    "model_dir": model_dir,
                    "args": train_args(work / "sw-pbf", bf16=True, use_cpu=True),
                },
                {
                    "model_dir": model_dir,
                    "args": train_args(work / "sw-p2", use_cpu=True, **EVAL),
                    "generate": True,
                    "final_logits": True,
                },
            ],
        },
        work,
        2,
        "torchrun",
    )
    assert_same_training(got["bf16"], plain_bf[0], BF16)
    feats, ref = got["features"], plain_bf[1]
    assert feats["after_load"]["all_partitioned"]
    torch.testing.assert_close(
        torch.tensor(feats["load_logits"]),
        torch.tensor(plain["fp32"]["load_logits"]),
        rtol=0,
        atol=1e-6,
    )
    assert_same_training(feats, ref, FP32)
    assert_close_losses(feats["eval_losses"], ref["eval_losses"], FP32)
    assert feats["generated"] == ref["generated"]
    saved = transformers.AutoModelForCausalLM.from_pretrained(str(work / "sw-saved")).eval()
    with torch.no_grad():
        logits = saved(input_ids=torch.arange(12).reshape(2, 6) * 7 % 256).logits
    torch.testing.assert_close(logits, torch.tensor(feats["final_logits"]), rtol=0, atol=1e-6)
    assert got["resumed"]["steps"] == [1, 2, 3, 4]
    assert_same_training(got["resumed"], got["features"], FP32, first=2)


REPO = Path(__file__).resolve().parents[1]


def test_example_runs_as_written(tmp_path):
    """examples/hf_trainer.py: the tiny built-in Llama, the shipped ZeRO-3 offload config."""
    import subprocess
    import sys

    from hf_route_helpers import clean_env

    text = tmp_path / "text.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 200)
    out = tmp_path / "run"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "examples" / "hf_trainer.py"),
            "--steps",
            "2",
            "--seq_length",
            "16",
            "--data",
            str(text),
            "--output_dir",
            str(out),
        ],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "trained by zero_offload.runtime.engine.engine.ZeroOffloadEngine" in done.stdout
    saved = transformers.AutoModelForCausalLM.from_pretrained(str(out / "final"))
    assert all(p.numel() > 0 for p in saved.parameters())


@pytest.mark.slow  # the benchmark script end to end: scripts/test_slow.sh
def test_benchmark_smoke(tmp_path):
    """benchmarks/hf_trainer.py runs its table (zero_offload rows; DeepSpeed's take minutes)."""
    import json
    import subprocess
    import sys

    from hf_route_helpers import clean_env

    out = tmp_path / "bench.json"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "hf_trainer.py"),
            *("--layers", "1", "--hidden", "32", "--vocab", "256", "--seq", "16"),
            *("--steps", "3", "--warmup", "1", "--rounds", "1", "--no-deepspeed"),
            *("--json", str(out)),
        ],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads(out.read_text())
    assert [r["mode"] for r in rows] == ["zero2-offload", "zero3-offload"]
    for r in rows:
        assert r["deepspeed_module"] == "zero_offload.deepspeed_compat"
        assert r["median_s"] > 0 and r["peak_rss_mib"] > 0 and r["timed_steps"] == 2
    assert abs(rows[0]["final_loss"] - rows[1]["final_loss"]) < 1e-4  # same run, two stages
