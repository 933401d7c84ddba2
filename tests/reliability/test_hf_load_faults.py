"""Issue 31, items 1 and 4: a Hugging Face folder loads at stage 3 as ``from_pretrained`` loads
it, or not at all, with an error naming the tensor and the file. Each case is a folder damaged
the way real folders are (hand-edited indexes, merged checkpoints, interrupted copies)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_models import tiny_model

transformers = pytest.importorskip("transformers")

STAGE3 = {
    "train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
}
IDS = torch.arange(12).reshape(2, 6) % 256
INDEX = "model.safetensors.index.json"


def _reference_logits(folder: Path) -> torch.Tensor:
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        return plain(input_ids=IDS).logits


def _stage3_logits(folder: Path) -> torch.Tensor:
    import zero_offload
    from zero_offload.hf import load_causal_lm

    model = load_causal_lm(str(folder), torch.float32, STAGE3)
    assert all(p.numel() == 0 for p in model.parameters())  # loaded straight into partitions
    engine, *_ = zero_offload.initialize(model=model, config=STAGE3)
    with torch.no_grad():
        logits = engine(input_ids=IDS).logits
    engine.destroy()
    return logits


def _sharded(folder: Path) -> dict:
    tiny_model("llama").save_pretrained(str(folder), max_shard_size="20KB")
    return json.loads((folder / INDEX).read_text())


def _write_index(folder: Path, index: dict) -> None:
    (folder / INDEX).write_text(json.dumps(index))


def test_tied_config_with_a_distinct_stored_head_loads_untied(tmp_path):
    from safetensors.torch import load_file, save_file

    model = tiny_model("llama")
    model.config.tie_word_embeddings = True  # the config ties, the files hold both apart
    model.save_pretrained(str(tmp_path))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["lm_head.weight"] = torch.randn_like(tensors["lm_head.weight"])
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    assert torch.equal(_stage3_logits(tmp_path), _reference_logits(tmp_path))


def test_a_tensor_the_index_omits_is_found_in_its_shard(tmp_path):
    index = _sharded(tmp_path)
    del index["weight_map"]["model.layers.0.mlp.down_proj.weight"]
    _write_index(tmp_path, index)
    assert torch.equal(_stage3_logits(tmp_path), _reference_logits(tmp_path))


def test_a_tensor_the_index_maps_to_the_wrong_shard_is_found_where_it_is(tmp_path):
    index = _sharded(tmp_path)
    wm = index["weight_map"]
    name = "model.layers.1.self_attn.q_proj.weight"
    wm[name] = next(f for f in sorted(set(wm.values())) if f != wm[name])
    _write_index(tmp_path, index)
    assert torch.equal(_stage3_logits(tmp_path), _reference_logits(tmp_path))


def test_a_tensor_no_file_holds_is_an_error_naming_it_and_the_index(tmp_path):
    from safetensors.torch import load_file, save_file

    index = _sharded(tmp_path)
    name = "model.layers.0.mlp.up_proj.weight"
    shard = tmp_path / index["weight_map"][name]
    tensors = load_file(str(shard))
    del tensors[name]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{name}: .*{INDEX} maps it to {shard.name}"):
        _stage3_logits(tmp_path)


@pytest.mark.parametrize("stage3", [True, False], ids=["stage3", "stage0-2"])
def test_a_truncated_shard_is_an_error_naming_the_file(tmp_path, stage3):
    from zero_offload.hf import load_causal_lm

    index = _sharded(tmp_path)
    shard = tmp_path / sorted(set(index["weight_map"].values()))[2]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])  # an interrupted copy
    with pytest.raises(ValueError, match=rf"{shard}: not a complete safetensors file"):
        load_causal_lm(str(tmp_path), torch.float32, STAGE3 if stage3 else None)


def test_train_cli_reports_a_truncated_file_in_one_line(tmp_path, capsys):
    from zero_offload.cli.main import main

    model = tmp_path / "m"
    tiny_model("llama").save_pretrained(str(model))
    single = model / "model.safetensors"
    single.write_bytes(single.read_bytes()[:-64])
    data = tmp_path / "train.txt"
    data.write_text("def f(x):\n    return x\n" * 200)
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(STAGE3))
    argv = ["train", "--model", str(model), "--data", str(data), "--out", str(tmp_path / "o")]
    capsys.readouterr()  # save_pretrained's progress bars
    assert main([*argv, "--steps", "1", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{single}: not a complete safetensors file" in err[0], err


def test_a_tensor_the_architecture_declares_optional_may_be_missing(tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    tiny_model("llama").save_pretrained(str(tmp_path))
    single = tmp_path / "model.safetensors"
    tensors = load_file(str(single))
    del tensors["model.layers.0.mlp.up_proj.weight"]
    save_file(tensors, str(single), metadata={"format": "pt"})
    cls = transformers.LlamaForCausalLM
    monkeypatch.setattr(cls, "_keys_to_ignore_on_load_missing", [r"layers\.0\.mlp\.up_proj"])
    _stage3_logits(tmp_path)  # loads (the param keeps its initial value, with a warning)
