"""DeepSpeed 0.19.8's strict config, against DeepSpeed itself where it is installed: the removed
features are refused by key in DeepSpeed's words (any value, as DeepSpeed checks presence);
prescale_gradients / gradient_predivide_factor at stage 3 are refused as DeepSpeed's ZeRO-3
optimizer refuses them; the new keys (compute_grad_norm, keep_in_fp32_modules,
disable_python_gc) are built with DeepSpeed's rules; and the one warning about accepted-but-not-
built keys names the file and only keys whose value changes training."""

from __future__ import annotations

import gc
import importlib.util
import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import zero_offload
from zero_offload.config import ConfigError, NotImplementedSettingWarning, load_config
from zero_offload.config.loading.removed import REMOVED_TOP_LEVEL, REMOVED_ZERO

BASE: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}
REMOVED = [({**BASE, key: {"enabled": False}}, key, msg) for key, msg in REMOVED_TOP_LEVEL.items()]
REMOVED += [
    ({**BASE, "zero_optimization": {"stage": 3, key: None}}, f"zero_optimization.{key}", msg)
    for key, msg in REMOVED_ZERO.items()
]


def _problems(config: dict) -> list[str]:
    with pytest.raises(ConfigError) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_config(config)
    return info.value.problems


@pytest.mark.parametrize(("config", "key", "message"), REMOVED, ids=[r[1] for r in REMOVED])
def test_removed_features_are_refused_by_key_in_deepspeeds_words(config, key, message) -> None:
    assert _problems(config) == [f"{key}: {message}"]


@pytest.mark.parametrize("kind", ["OneBitAdam", "ZeroOneAdam", "onebitlamb"])
def test_removed_optimizers_are_refused_by_key(kind: str) -> None:
    (line,) = _problems({**BASE, "optimizer": {"type": kind, "params": {"lr": 1e-3}}})
    assert line.startswith(f'optimizer.type: "{kind}": DeepSpeed\'s') and "removed" in line


@pytest.mark.parametrize(
    ("extra", "key", "words"),
    [
        ({"prescale_gradients": True}, "prescale_gradients", "pre-scale gradients is not yet"),
        ({"gradient_predivide_factor": 2.0}, "gradient_predivide_factor", "!= 1.0 is not yet"),
    ],
)
def test_prescaling_at_stage3_is_refused_as_deepspeed_refuses_it(extra, key, words) -> None:
    (line,) = _problems({**BASE, **extra, "zero_optimization": {"stage": 3}})
    assert line.startswith(f"{key}: ") and words in line and "ZeRO-3" in line
    with warnings.catch_warnings(record=True) as caught:  # stage 2: loads, warned
        warnings.simplefilter("always")
        load_config({**BASE, **extra, "zero_optimization": {"stage": 2}})
    assert len(caught) == 1 and key in str(caught[0].message)


@pytest.mark.parametrize(
    ("zero", "clip", "words"),
    [
        ({"stage": 3}, 0.0, "supported only with ZeRO Stage 1 or 2"),
        ({"stage": 0}, 0.0, "supported only with ZeRO Stage 1 or 2"),
        ({"stage": 2}, 1.0, "requires gradient_clipping=0"),
        ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, 0.0, "optimizer offload"),
    ],
)
def test_compute_grad_norm_false_where_deepspeed_refuses_it(zero, clip, words) -> None:
    config = {**BASE, "gradient_clipping": clip, "zero_optimization": {**zero}}
    config["zero_optimization"]["compute_grad_norm"] = False
    (line,) = _problems(config)
    assert line.startswith("zero_optimization.compute_grad_norm: ") and words in line


def _train(config: dict, model: torch.nn.Module, steps: int = 2):
    engine, *_ = zero_offload.initialize(model=model, config=config)
    torch.manual_seed(3)
    losses, norms = [], []
    for _ in range(steps):
        loss = engine(torch.randn(4, 8)).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(engine.get_global_grad_norm())
    return engine, losses, norms


def test_compute_grad_norm_false_reports_none_and_trains_the_same() -> None:
    config = {
        **BASE,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 2},
    }
    torch.manual_seed(0)
    _, ref, ref_norms = _train(config, torch.nn.Linear(8, 8))
    off = {**config, "zero_optimization": {"stage": 2, "compute_grad_norm": False}}
    torch.manual_seed(0)
    _, losses, norms = _train(off, torch.nn.Linear(8, 8))
    assert losses == ref and all(n is not None for n in ref_norms) and norms == [None, None]


class Router(torch.nn.Module):
    _keep_in_fp32_modules_strict = ["bias_correction"]

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.register_buffer("bias_correction", torch.linspace(5, 5.01, 8))
        self.register_buffer("scale", torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.scale + self.bias_correction


@pytest.mark.parametrize(
    ("setting", "kept"),
    [("auto", {"bias_correction"}), (["scal*"], {"scale"}), ([], set())],
)
def test_keep_in_fp32_modules_keeps_the_named_buffers_fp32(setting, kept) -> None:
    config = {
        **BASE,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 1},
        "data_types": {"buffer_dtype": "bf16", "keep_in_fp32_modules": setting},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = zero_offload.initialize(model=Router(), config=config)
    dtypes = {name: b.dtype for name, b in engine.module.named_buffers()}
    assert {n for n, d in dtypes.items() if d == torch.float32} == kept
    assert engine.module.proj.weight.dtype == torch.bfloat16  # params follow the training dtype
    engine.destroy()


def test_keep_in_fp32_modules_refuses_what_deepspeed_refuses() -> None:
    (line,) = _problems({**BASE, "data_types": {"keep_in_fp32_modules": "all"}})
    assert line.startswith("data_types.keep_in_fp32_modules: ") and '"auto" or a list' in line


def test_disable_python_gc_holds_gc_off_while_the_engine_lives() -> None:
    assert gc.isenabled()
    config = {**BASE, "disable_python_gc": True, "optimizer": {"type": "AdamW"}}
    engine, *_ = zero_offload.initialize(model=torch.nn.Linear(4, 4), config=config)
    try:
        assert not gc.isenabled()
        assert isinstance(engine.collect_python_gc(), int)
    finally:
        engine.destroy()
    assert gc.isenabled()


# ---- the not-built warning --------------------------------------------------------------------

HF_RECIPE = {  # a typical recipe: the not-built keys it carries are off or tune speed/logging
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "steps_per_print": 2000,
    "wall_clock_breakdown": False,
    "zero_allow_untested_optimizer": True,
    "communication_data_type": None,
    "dataloader_drop_last": False,
    "flops_profiler": {"enabled": False, "profile_step": 1},
    "tensorboard": {"enabled": False},
    "wandb": {"enabled": False},
    "csv_monitor": {"enabled": False},
    "comms_logger": {"enabled": False},
    "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False},
    "zero_optimization": {
        "stage": 2,
        "contiguous_gradients": True,
        "round_robin_gradients": True,
        "zero_quantized_weights": False,
        "zero_hpz_partition_size": 1,
        "use_multi_rank_bucket_allreduce": False,
    },
}


def test_a_typical_recipe_loads_without_a_warning() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = load_config(HF_RECIPE)
    assert [str(w.message) for w in caught] == []
    assert "wandb" in config.ignored_keys  # still recorded as not built


def test_the_warning_names_the_file_and_says_what_differs(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    recipe = {**HF_RECIPE, "communication_data_type": "bf16"}
    recipe["zero_optimization"] = {"stage": 2, "zero_quantized_gradients": True}
    path.write_text(json.dumps(recipe))
    with pytest.warns(NotImplementedSettingWarning) as caught:
        load_config(str(path))
    (message,) = [str(w.message) for w in caught]
    assert message.startswith(f"{path}: DeepSpeed settings accepted but not built here")
    assert 'communication_data_type="bf16" (gradients are reduced in the gradient dtype' in message
    assert (
        "zero_optimization.zero_quantized_gradients=true (gradients are reduced unquantized)"
        in (message)
    )
    assert "wandb" not in message and "<dict>" not in message


_HF_READER = r"""
import json, sys, warnings
import torch
from accelerate.utils.deepspeed import HfDeepSpeedConfig
import deepspeed
hf = HfDeepSpeedConfig(sys.argv[1])  # reads the file, as the Trainer and Accelerate do
model = torch.nn.Linear(4, 4)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    deepspeed.initialize(model=model, model_parameters=model.parameters(), config_params=hf.config)
print("RESULT" + json.dumps([str(w.message) for w in caught]))
"""


def test_the_file_hugging_face_read_is_named_under_the_opt_in(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    from hf_route_helpers import clean_env

    path = tmp_path / "ds.json"
    recipe = {**HF_RECIPE, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    recipe["zero_optimization"] = {"stage": 2, "zero_quantized_gradients": True}
    path.write_text(json.dumps(recipe))
    proc = subprocess.run(
        [sys.executable, "-c", _HF_READER, str(path)],
        env=clean_env(opt_in=True),
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = next((s for s in proc.stdout.splitlines() if s.startswith("RESULT")), None)
    assert line is not None, proc.stderr[-3000:]
    (message,) = json.loads(line[len("RESULT") :])
    assert message.startswith(f"{path}: ") and "zero_quantized_gradients=true" in message


# ---- DeepSpeed itself, when installed -----------------------------------------------------------

_DS_SCRIPT = r"""
import json, logging, os, sys, warnings
os.environ.setdefault("DS_ACCELERATOR", "cpu")
logging.disable(logging.CRITICAL)
warnings.simplefilter("ignore")
from deepspeed.runtime.config import DeepSpeedConfig
out = []
for source in json.load(sys.stdin):
    try:
        DeepSpeedConfig(source)
        out.append({"ok": True})
    except Exception as e:
        out.append({"ok": False, "type": type(e).__name__, "msg": str(e)})
print("RESULT" + json.dumps(out))
"""


def test_deepspeed_refuses_the_same_keys_with_the_same_words() -> None:
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    new_keys = [
        {**BASE, "zero_optimization": {"stage": 3, "compute_grad_norm": False}},
        {**BASE, "data_types": {"keep_in_fp32_modules": "all"}},
        {**BASE, "data_types": {"keep_in_fp32_modules": ["norm"]}, "disable_python_gc": True},
        {**BASE, "zero_optimization": {"stage": 2, "compute_grad_norm": False}},
        HF_RECIPE,
    ]
    sources = [config for config, _, _ in REMOVED] + new_keys
    proc = subprocess.run(
        [sys.executable, "-c", _DS_SCRIPT],
        input=json.dumps(sources),
        capture_output=True,
        text=True,
        timeout=600,
    )
    line = next((s for s in proc.stdout.splitlines() if s.startswith("RESULT")), None)
    assert line is not None, proc.stderr[-2000:]
    verdicts = json.loads(line[len("RESULT") :])
    for (config, key, message), verdict in zip(REMOVED, verdicts):
        assert (verdict["ok"], verdict["type"]) == (False, "DeepSpeedConfigError"), key
        assert verdict["msg"].strip() == message, key  # DeepSpeed's words (less a trailing space)
        assert _problems(config) == [f"{key}: {message}"]
    refused_s3, refused_kif, accepted_kif, accepted_s2, recipe = verdicts[len(REMOVED) :]
    assert not refused_s3["ok"] and "supported only with ZeRO Stage 1 or 2" in refused_s3["msg"]
    assert refused_kif["type"] == "DeepSpeedConfigError" and "a list of name" in refused_kif["msg"]
    assert accepted_kif["ok"] and accepted_s2["ok"] and recipe["ok"]
    _problems(new_keys[0])
    _problems(new_keys[1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(new_keys[2])
        load_config(HF_RECIPE)
