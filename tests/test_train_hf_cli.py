"""``zero-offload train --model``: a local Hugging Face folder fine-tuned (fully or with LoRA)
under a ZeRO config, exported with save_pretrained; and the CLI's error contract."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from hf_models import save_tiny

from zero_offload.cli.main import main

transformers = pytest.importorskip("transformers")

TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(600))


def _args(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--model",
        str(model),
        "--data",
        str(data),
        "--out",
        str(out),
        "--steps",
        "4",
        "--seq-length",
        "16",
        "--batch-size",
        "2",
        "--eval-batches",
        "1",
        "--log-every",
        "0",
        *extra,
    ]


def _loss(model, ids: torch.Tensor) -> float:
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "train.txt"
    path.write_text(TEXT)
    return path


# Threshold 0: every weight is partitioned (the tiny models' weights are all under the default
# persistence threshold, which would leave them whole and the stage-3 export path untested).
STAGE3_OFFLOAD = {
    "stage": 3,
    "offload_optimizer": {"device": "cpu"},
    "offload_param": {"device": "cpu"},
    "stage3_param_persistence_threshold": 0,
}


@pytest.mark.parametrize(
    "zero", [{"stage": 1, "offload_optimizer": {"device": "cpu"}}, STAGE3_OFFLOAD], ids=["s1", "s3"]
)
def test_full_finetune_exports_a_loadable_model(tmp_path, corpus, capsys, zero):
    initial = save_tiny("llama", tmp_path / "llama")
    config = tmp_path / "ds.json"
    config.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": 2,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                "zero_optimization": zero,
            }
        )
    )
    out = tmp_path / "run"
    assert main(_args(tmp_path / "llama", corpus, out, "--config", str(config))) == 0
    assert "byte-level tokens" in capsys.readouterr().out
    trained = transformers.AutoModelForCausalLM.from_pretrained(str(out / "hf_model"))
    assert type(trained).__name__ == "LlamaForCausalLM"
    ids = torch.tensor([list(TEXT[:64].encode())])
    assert _loss(trained, ids) < _loss(initial, ids)  # it learned the text
    run = json.loads((out / "run.json").read_text())
    assert run["exported"] == ["hf_model"]
    if zero["stage"] == 3:  # every weight was partitioned, and the export gathered it
        assert run["partitioned_parameters"] == len(list(trained.parameters())) > 0
        assert all(p.numel() > 0 for p in trained.parameters())


@pytest.mark.parametrize("stage3", [False, True], ids=["default", "s3"])
def test_lora_trains_adapters_and_exports_merged_and_adapter(tmp_path, corpus, stage3):
    pytest.importorskip("peft")
    initial = save_tiny("gpt2", tmp_path / "gpt2")
    out = tmp_path / "run"
    extra = ["--lora", "--lora-r", "4"]
    if stage3:
        config = tmp_path / "ds.json"
        config.write_text(
            json.dumps({"train_micro_batch_size_per_gpu": 2, "zero_optimization": STAGE3_OFFLOAD})
        )
        extra += ["--config", str(config)]
    assert main(_args(tmp_path / "gpt2", corpus, out, *extra)) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(out / "hf_model"))
    assert (out / "hf_model_adapter" / "adapter_config.json").is_file()
    base, new = dict(initial.named_parameters()), dict(merged.named_parameters())
    # LoRA adapts c_attn only: it changed, everything else is the base model's.
    assert not torch.equal(
        base["transformer.h.0.attn.c_attn.weight"], new["transformer.h.0.attn.c_attn.weight"]
    )
    assert torch.equal(base["transformer.wte.weight"], new["transformer.wte.weight"])
    assert torch.equal(
        base["transformer.h.1.mlp.c_fc.weight"], new["transformer.h.1.mlp.c_fc.weight"]
    )


def test_config_error_is_one_line_on_stderr_naming_file_and_key(tmp_path, capsys):
    config = tmp_path / "bad.json"
    config.write_text(
        json.dumps({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 7}})
    )
    assert main(["train", "--config", str(config), "--steps", "1"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err and captured.out == ""
    assert lines[0].startswith(f"zero-offload train: error: {config}: zero_optimization.stage")


def test_batch_size_disagreeing_with_config_says_which_to_change(tmp_path, capsys):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4}))
    assert main(["train", "--config", str(config), "--batch-size", "2", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(config) in err
    assert "change --batch-size to 4, or the config's train_micro_batch_size_per_gpu to 2" in err


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--lora"], "--lora needs --model"),
        (["--model", "/nonexistent/model"], "no config.json"),
    ],
)
def test_bad_hf_arguments_are_errors(extra, message, capsys):
    assert main(["train", "--steps", "1", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_missing_transformers_names_the_extra(tmp_path, corpus, capsys, monkeypatch):
    save_tiny("gpt2", tmp_path / "gpt2")
    monkeypatch.setitem(sys.modules, "transformers", None)  # import now raises ImportError
    assert main(_args(tmp_path / "gpt2", corpus, tmp_path / "run")) == 2
    err = capsys.readouterr().err
    assert "needs the 'transformers' package" in err and "zero_offload[hf]" in err


@pytest.mark.parametrize("zero", [None, STAGE3_OFFLOAD], ids=["as-written", "s3"])
def test_example_finetune_hf_runs_as_written(tmp_path, zero):
    from importlib.util import module_from_spec, spec_from_file_location

    path = Path(__file__).resolve().parents[1] / "examples" / "finetune_hf.py"
    spec = spec_from_file_location("finetune_hf", path)
    example = module_from_spec(spec)
    spec.loader.exec_module(example)
    if zero is not None:  # its save must gather the partitioned weights
        example.ds_config["zero_optimization"] = zero
    out = tmp_path / "finetuned"
    loss = example.main(["--steps", "2", "--max-bytes", "50000", "--out", str(out)])
    assert 0 < loss < 10
    saved = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert saved.config.model_type == "llama"
    assert all(p.numel() > 0 for p in saved.parameters())
