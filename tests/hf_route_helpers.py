"""Helpers of the Hugging Face route tests (Trainer, Accelerate, TRL on zero_offload through the
``deepspeed`` opt-in): tiny saved models, DeepSpeed configs as a Trainer user writes them (HF's
``"auto"`` values), and the scripts in ``tests/hf_route/`` run in subprocesses (the opt-in must
happen before transformers is imported, so never in the pytest process), alone or under
torchrun / ``accelerate launch``. Rank 0 of each script prints ``RESULT <json>``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

HERE = Path(__file__).parent
SCRIPTS = HERE / "hf_route"
BIN = Path(sys.executable).parent
ENV_VAR = "ZERO_OFFLOAD_AS_DEEPSPEED"
TIMEOUT = 900  # seconds: a hang guard only


def tiny_llama_dir(path: Path, seed: int = 0, hidden: int = 32) -> Path:
    """A tiny Llama, saved with save_pretrained (weights in fp32)."""
    import torch

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    model.save_pretrained(str(path))
    return path


def ds_config(
    stage: int,
    offload: bool = False,
    offload_param: bool = False,
    optimizer_block: bool = False,
    scheduler_block: bool = False,
    gather_16bit: bool = False,
) -> dict:
    """A DeepSpeed config the way Hugging Face's docs write one: "auto" wherever the Trainer
    fills the value in. Stage 3 partitions every param (persistence threshold 0: the tiny
    models' weights are all under the default threshold)."""
    zero: dict = {"stage": stage, "reduce_bucket_size": "auto"}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if stage == 3:
        zero["stage3_prefetch_bucket_size"] = "auto"
        zero["stage3_param_persistence_threshold"] = 0
        zero["stage3_gather_16bit_weights_on_model_save"] = gather_16bit
    cfg: dict = {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "fp16": {"enabled": "auto"},
        "bf16": {"enabled": "auto"},
        "zero_optimization": zero,
    }
    if optimizer_block:
        cfg["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        }
    if scheduler_block:
        cfg["scheduler"] = {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto",
                "total_num_steps": "auto",
            },
        }
    return cfg


def train_args(out: Path, **over) -> dict:
    """TrainingArguments shared by a run and its plain reference (weight decay 0: the config
    optimizer block decays every param, the Trainer's own optimizer skips norms and biases)."""
    args = {
        "output_dir": str(out),
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "max_steps": 4,
        "logging_steps": 1,
        "learning_rate": 1e-2,
        "weight_decay": 0.0,
        "seed": 0,
        "data_seed": 0,
        "save_strategy": "no",
        "dataloader_num_workers": 0,
    }
    args.update(over)
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(opt_in: bool = False, threads: int | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        ZERO_OFFLOAD_DEVICE="cpu",
        CUDA_VISIBLE_DEVICES="",  # no GPU either for transformers and accelerate to move batches to
        PYTHONWARNINGS="ignore",
    )
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    if opt_in:
        env[ENV_VAR] = "1"
    return env


def run_script(
    script: str,
    spec: dict,
    tmp: Path,
    nproc: int = 1,
    launcher: str = "python",
    opt_in_env: bool = False,
    extra_launch: list[str] | None = None,
) -> list | dict:
    """Run ``tests/hf_route/<script>`` with ``spec`` (as a JSON file); return rank 0's RESULT.
    ``launcher``: "python" (one process, no launcher), "torchrun", or "accelerate"."""
    spec_path = tmp / f"spec_{os.getpid()}_{len(list(tmp.glob('spec_*')))}.json"
    spec_path.write_text(json.dumps(spec))
    path = str(SCRIPTS / script)
    if launcher == "python":
        cmd = [sys.executable, path, str(spec_path)]
    elif launcher == "torchrun":
        cmd = [
            str(BIN / "torchrun"),
            f"--nproc_per_node={nproc}",
            f"--master_port={free_port()}",
            path,
            str(spec_path),
        ]
    elif launcher == "accelerate":
        cmd = [
            str(BIN / "accelerate"),
            "launch",
            f"--num_processes={nproc}",
            f"--main_process_port={free_port()}",
            *(extra_launch or []),
            path,
            str(spec_path),
        ]
    else:
        raise ValueError(launcher)
    env = clean_env(opt_in=opt_in_env, threads=1 if nproc > 1 else None)
    proc = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT, cwd=str(tmp)
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}"
            f"\n--- stderr\n{proc.stderr[-12000:]}"
        )
    return json.loads(lines[-1][len("RESULT ") :])


def assert_close_series(what: str, got: list, ref: list, rel: float) -> None:
    """Step by step, ``got`` within ``rel`` (relative) of the plain run's ``ref``."""
    assert len(got) == len(ref) and got, (what, got, ref)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert a is not None and b is not None, f"{what}: step {i + 1} not logged\n{got}\n{ref}"
        assert abs(a - b) <= rel * abs(b), (
            f"{what}, step {i + 1}: {a} vs plain {b} (rel tol {rel})\n{got}\n{ref}"
        )


def assert_close_losses(got: list[float], ref: list[float], rel: float) -> None:
    assert_close_series("loss", got, ref, rel)


LR_TOL = 1e-6  # the schedule is arithmetic on the step count: no precision to lose


def assert_same_training(
    got: dict, ref: dict, rel: float, first: int = 0, lr_after_step: bool = False
) -> None:
    """Per logged step from ``first`` on: the loss, the gradient norm before clipping (a wrong
    1/GAS or 1/world factor in the gradients scales it, where AdamW and clipping leave the
    loss almost unchanged) and the learning rate; then the trained params where both runs
    recorded them (``final_params``). ``lr_after_step``: a scheduler built from the config
    (an optimizer block) is stepped inside the engine's step, as DeepSpeed's is, before the
    Trainer reads the rate it logs, so each logged rate is the plain run's next one."""
    assert_close_series("loss", got["losses"][first:], ref["losses"][first:], rel)
    assert_close_series("grad norm", got["grad_norms"][first:], ref["grad_norms"][first:], rel)
    lrs, ref_lrs = got["lrs"][first:], ref["lrs"][first:]
    if lr_after_step:
        lrs, ref_lrs = lrs[:-1], ref_lrs[1:]
    assert_close_series("learning rate", lrs, ref_lrs, LR_TOL)
    if "final_params" in got and "final_params" in ref:
        assert_close_params(got["final_params"], ref["final_params"], rel)


def assert_close_params(got: dict, ref: dict, rel: float) -> None:
    """Each param's [sum, norm] within ``rel`` of the plain run's, relative to its norm."""
    assert got.keys() == ref.keys() and got, (sorted(got), sorted(ref))
    for name, (s_ref, n_ref) in ref.items():
        s_got, n_got = got[name]
        scale = rel * max(n_ref, 1e-12)
        assert abs(n_got - n_ref) <= scale and abs(s_got - s_ref) <= scale, (
            f"param {name}: [sum, norm] {got[name]} vs plain {ref[name]} (rel tol {rel})"
        )
