import csv
import json
import math
import os
import socket
import subprocess
import sys
from importlib.util import module_from_spec, spec_from_file_location
from pathlib import Path

import pytest

import zero_offload
from zero_offload.cli.main import main
from zero_offload.cli.train.command import DEFAULT_CONFIG, METRIC_COLUMNS, resolve_config

REPO = Path(__file__).resolve().parents[1]
SRC = Path(zero_offload.__file__).resolve().parents[1]
SMALL = ["--preset", "tiny", "--max-bytes", "300000", "--eval-batches", "2"]


def read_metrics(folder: Path) -> list[dict[str, str]]:
    with open(folder / "metrics.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_builtin_config_decays_over_the_run_and_is_not_mutated() -> None:
    config, steps, notes = resolve_config(None, 40)
    assert steps == 40 and notes == []
    sched = config["scheduler"]["params"]
    assert (sched["total_num_steps"], sched["warmup_num_steps"]) == (40, 4)
    assert config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert config["bf16"]["enabled"] is False
    assert resolve_config(None, None, cuda_bf16=True)[0]["bf16"]["enabled"] is True
    assert DEFAULT_CONFIG["scheduler"]["params"]["total_num_steps"] == 300


def test_tutorial_config_gets_batch_and_optimizer_filled_in(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    config, _, notes = resolve_config(str(path), 20)
    assert config["zero_optimization"] == {"stage": 1}
    assert config["train_micro_batch_size_per_gpu"] == 16
    assert config["optimizer"]["type"] == "AdamW"
    assert config["scheduler"]["params"]["total_num_steps"] == 20
    assert len(notes) == 2


def test_user_optimizer_and_schedule_are_kept(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    user = {
        "train_batch_size": 8,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 5}},
    }
    path.write_text(json.dumps(user))
    config, _, notes = resolve_config(str(path), 50)
    assert notes == [] and config["optimizer"] == user["optimizer"]
    assert "train_micro_batch_size_per_gpu" not in config
    assert config["scheduler"]["params"] == {"warmup_num_steps": 5, "total_num_steps": 50}


def test_bad_steps_is_named() -> None:
    with pytest.raises(ValueError, match="--steps"):
        resolve_config(None, 0)


def test_train_writes_metrics_plot_and_config(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    assert main(["train", *SMALL, "--steps", "6", "--out", str(out), "--log-every", "3"]) == 0
    rows = read_metrics(out)
    assert list(rows[0]) == list(METRIC_COLUMNS)
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5, 6]
    losses = [float(r["loss"]) for r in rows]
    assert losses[0] == pytest.approx(math.log(256), abs=0.3)
    assert losses[-1] < losses[0] - 0.2  # six steps already move a byte-level model off uniform
    assert all(float(r["tokens_per_s"]) > 0 and float(r["mem_mib"]) > 0 for r in rows)
    assert all(float(r["grad_norm"]) > 0 and float(r["loss_scale"]) == 1.0 for r in rows)
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    config = json.loads((out / "config.json").read_text())
    assert config["zero_optimization"]["stage"] == 2
    assert config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    result = json.loads((out / "run.json").read_text())
    assert result["steps"] == 6 and result["world_size"] == 1
    assert math.isfinite(result["heldout_loss"]) and result["heldout_loss"] < math.log(256)
    # the memory by term: the host states of stage 2 + offload, the step's peaks beside them
    memory = result["memory"]
    assert memory["host.optimizer_state"] > 0 and memory["host.master_shard"] > 0
    assert any(k.startswith("peak.") for k in memory)
    printed = capsys.readouterr().out
    assert str(out) in printed and "held-out" in printed
    assert "memory (MiB): " in printed and "host.optimizer_state" in printed


def test_train_stage3_config_with_both_offloads(tmp_path: Path) -> None:
    out = tmp_path / "run"
    config = REPO / "configs" / "gpt2_stage3_offload.json"
    args = ["train", *SMALL, "--config", str(config), "--steps", "4", "--out", str(out)]
    assert main([*args, "--save-every", "2", "--checkpoint-activations"]) == 0
    losses = [float(r["loss"]) for r in read_metrics(out)]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert json.loads((out / "config.json").read_text())["zero_optimization"]["stage"] == 3
    assert (out / "checkpoints" / "global_step4").is_dir()


def test_train_rejects_bad_model_flags(tmp_path: Path, capsys) -> None:
    argv = ["train", *SMALL, "--hidden-size", "30", "--out", str(tmp_path / "r")]
    assert main(argv) == 2
    assert "num_attention_heads" in capsys.readouterr().err  # errors go to stderr
    assert not (tmp_path / "r").exists()


def test_train_on_two_ranks_through_the_launcher(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "zero_offload.cli.main", "launch", "--num_gpus", "2"]
    cmd += ["--master_port", str(free_port()), "--module", "zero_offload.cli.main", "train"]
    cmd += [*SMALL, "--steps", "3", "--out", str(out)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=1200)
    # torchrun exits 0 only when every rank did; rank 1 also joined rank 0's final collectives.
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(read_metrics(out)) == 3
    result = json.loads((out / "run.json").read_text())
    assert result["world_size"] == 2
    assert result["tokens_per_step"] == 2 * 16 * 64
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # rank 1 wrote nothing


def load_example():
    spec = spec_from_file_location("pretrain_gpt2", REPO / "examples" / "pretrain_gpt2.py")
    module = module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_trains_with_the_tutorial_config(capsys) -> None:
    example = load_example()
    example.main(
        ["--model-parallel-size", "1", "--num-layers", "2", "--hidden-size", "64"]
        + ["--num-attention-heads", "4", "--seq-length", "32", "--batch-size", "4"]
        + ["--train-iters", "4", "--log-interval", "2", "--deepspeed"]
        + ["--deepspeed_config", str(REPO / "configs" / "ds_zero_stage_2.config")]
    )
    lines = [line for line in capsys.readouterr().out.splitlines() if "lm loss" in line]
    assert len(lines) == 2 and "iteration        4/       4" in lines[-1]


def test_example_refuses_model_parallelism(capsys) -> None:
    example = load_example()
    with pytest.raises(SystemExit):
        example.get_args(["--model-parallel-size", "2", "--deepspeed_config", "x.json"])
    assert "--model-parallel-size must be 1" in capsys.readouterr().err


def test_save_every_and_resume_continue_exactly(tmp_path: Path) -> None:
    straight, first, resumed = tmp_path / "straight", tmp_path / "first", tmp_path / "resumed"
    assert main(["train", *SMALL, "--steps", "6", "--out", str(straight)]) == 0
    assert main(["train", *SMALL, "--steps", "3", "--save-every", "3", "--out", str(first)]) == 0
    assert (first / "checkpoints" / "latest").read_text().strip() == "global_step3"
    ckpt = str(first / "checkpoints")
    assert main(["train", *SMALL, "--steps", "6", "--resume", ckpt, "--out", str(resumed)]) == 0
    want = [row["loss"] for row in read_metrics(straight)][3:]
    got = [row["loss"] for row in read_metrics(resumed)]
    assert [row["step"] for row in read_metrics(resumed)] == ["4", "5", "6"]
    assert got == want  # bitwise equal losses (as printed to 6 digits)
    assert (
        main(["train", *SMALL, "--resume", str(tmp_path / "none"), "--out", str(tmp_path / "x")])
        == 2
    )
