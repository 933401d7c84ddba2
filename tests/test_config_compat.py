"""Configs DeepSpeed accepts load here too, and its refusals are refused here with the exception
classes a DeepSpeed script catches.

* Numeric strings: read as numbers where DeepSpeed's pydantic sections read them (fp16,
  zero_optimization and its offload blocks, lax mode), errors naming the key elsewhere (the keys
  DeepSpeed stores as given and then fails on: the batch triple, gradient_clipping,
  steps_per_print, optimizer and scheduler params).
* Config files are read as Hjson when the hjson package is importable, as DeepSpeed reads them.
* ``args.deepscale_config``, DeepSpeed's old flag, is read when ``deepspeed_config`` is absent.
* fp16 loss-scaling keys are checked only where they act (fp16 enabled, dynamic scaling).
* ConfigError is a ValueError, an AssertionError and a DeepSpeedConfigError.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import pickle
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

import zero_offload
import zero_offload.config
from zero_offload.config import (
    ConfigError,
    DeepSpeedConfigError,
    NotImplementedSettingWarning,
    ZeroOffloadConfig,
    load_config,
)
from zero_offload.config.loading import json_text

BASE: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2}


def quiet(config: dict[str, Any], world_size: int = 1) -> ZeroOffloadConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotImplementedSettingWarning)
        return load_config(config, world_size)


def problems(config: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        quiet(config)
    return info.value.problems


def lookup(cfg: ZeroOffloadConfig, path: str) -> Any:
    node: Any = cfg
    for part in path.split("."):
        node = getattr(node, part)
    return node


# ---- 1. numeric strings ---------------------------------------------------------------------

# (config, path of the value, the number it is read as). Each loads in DeepSpeed too.
ACCEPTED_STRINGS = [
    ({"fp16": {"enabled": True, "loss_scale": "3"}}, "fp16.loss_scale", 3.0),
    ({"fp16": {"enabled": True, "loss_scale": "1e3"}}, "fp16.loss_scale", 1000.0),
    ({"fp16": {"enabled": True, "initial_scale_power": "8"}}, "fp16.initial_scale_power", 8),
    ({"fp16": {"enabled": True, "initial_scale_power": "8.0"}}, "fp16.initial_scale_power", 8),
    ({"fp16": {"enabled": True, "loss_scale_window": "500"}}, "fp16.loss_scale_window", 500),
    ({"fp16": {"enabled": True, "hysteresis": "3"}}, "fp16.hysteresis", 3),
    ({"fp16": {"enabled": True, "min_loss_scale": "2"}}, "fp16.min_loss_scale", 2.0),
    (
        {"zero_optimization": {"stage": 2, "reduce_bucket_size": "500000000"}},
        "zero_optimization.reduce_bucket_size",
        500_000_000,
    ),
    (
        {"zero_optimization": {"stage": 2, "reduce_bucket_size": " 5_000 "}},
        "zero_optimization.reduce_bucket_size",
        5000,
    ),
    (
        {"zero_optimization": {"stage": 2, "allgather_bucket_size": "200000000"}},
        "zero_optimization.allgather_bucket_size",
        200_000_000,
    ),
    ({"zero_optimization": {"stage": "2"}}, "zero_optimization.stage", 2),
    (
        {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "5000"}},
        "zero_optimization.stage3_prefetch_bucket_size",
        5000,
    ),
    (  # DeepSpeed's unprefixed spelling
        {"zero_optimization": {"stage": 3, "prefetch_bucket_size": "5000"}},
        "zero_optimization.stage3_prefetch_bucket_size",
        5000,
    ),
    (
        {"zero_optimization": {"stage": 3, "sub_group_size": "1000"}},
        "zero_optimization.sub_group_size",
        1000,
    ),
    (
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": "1"}}},
        "zero_optimization.offload_optimizer.ratio",
        1.0,
    ),
    (
        {
            "zero_optimization": {
                "stage": 2,
                "offload_optimizer": {"device": "cpu", "buffer_count": "8"},
            }
        },
        "zero_optimization.offload_optimizer.buffer_count",
        8,
    ),
    (
        {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "max_in_cpu": "7"}}},
        "zero_optimization.offload_param.max_in_cpu",
        7,
    ),
]


@pytest.mark.parametrize("extra, path, expected", ACCEPTED_STRINGS)
def test_numeric_string_deepspeed_reads_is_converted(extra, path, expected) -> None:
    cfg = quiet({**BASE, **extra})
    value = lookup(cfg, path)
    assert value == expected and type(value) is type(expected)
    # The resolved config holds the number, so it loads again as a number.
    assert quiet(cfg.to_dict()).to_dict() == cfg.to_dict()


# (config, the key path the error must name). DeepSpeed refuses each too: at load (a TypeError
# from its batch arithmetic, a pydantic ValidationError) or, for the strings it stores unconverted
# (gradient_clipping, steps_per_print, optimizer and scheduler params), at its first use.
REFUSED_STRINGS = [
    ({"train_micro_batch_size_per_gpu": "4"}, "train_micro_batch_size_per_gpu"),
    ({"train_batch_size": "4"}, "train_batch_size"),
    ({**BASE, "gradient_accumulation_steps": "2"}, "gradient_accumulation_steps"),
    (
        {**BASE, "zero_optimization": {"reduce_bucket_size": "5e8"}},
        "zero_optimization.reduce_bucket_size",
    ),
    (
        {**BASE, "zero_optimization": {"reduce_bucket_size": "abc"}},
        "zero_optimization.reduce_bucket_size",
    ),
    ({**BASE, "zero_optimization": {"stage": "two"}}, "zero_optimization.stage"),
    ({**BASE, "zero_optimization": {"stage": "4"}}, "zero_optimization.stage"),
    ({**BASE, "fp16": {"enabled": True, "loss_scale": "abc"}}, "fp16.loss_scale"),
    ({**BASE, "fp16": {"enabled": True, "initial_scale_power": "8.5"}}, "fp16.initial_scale_power"),
    ({**BASE, "fp16": {"enabled": True, "loss_scale_window": "1e3"}}, "fp16.loss_scale_window"),
    ({**BASE, "fp16": {"enabled": True, "loss_scale_window": "1000.0"}}, "fp16.loss_scale_window"),
    ({**BASE, "fp16": {"enabled": True, "min_loss_scale": "0.5"}}, "fp16.min_loss_scale"),
]
# DeepSpeedConfig stores these as the strings given; the engine then fails on them.
REFUSED_LATER_BY_DEEPSPEED = [
    ({**BASE, "gradient_clipping": "1.0"}, "gradient_clipping"),
    ({**BASE, "steps_per_print": "10"}, "steps_per_print"),
    ({**BASE, "optimizer": {"type": "AdamW", "params": {"lr": "1e-3"}}}, "optimizer.params.lr"),
    (
        {**BASE, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "10"}}},
        "scheduler.params.warmup_num_steps",
    ),
]


@pytest.mark.parametrize("config, key", REFUSED_STRINGS + REFUSED_LATER_BY_DEEPSPEED)
def test_string_deepspeed_does_not_read_is_an_error_naming_the_key(config, key) -> None:
    lines = problems(config)
    assert len(lines) == 1 and lines[0].startswith(f"{key}: "), lines


def test_quoted_number_error_says_how_to_fix() -> None:
    (line,) = problems({"train_micro_batch_size_per_gpu": "4"})
    assert line == (
        'train_micro_batch_size_per_gpu: expected an integer, got "4" '
        "(a number in quotes: write it without the quotes)"
    )
    (line,) = problems({**BASE, "zero_optimization": {"reduce_bucket_size": "abc"}})
    assert line == 'zero_optimization.reduce_bucket_size: expected an integer, got "abc"'


@pytest.mark.parametrize(
    "extra, key, fragment",
    [
        (
            {"zero_optimization": {"reduce_bucket_size": "0"}},
            "zero_optimization.reduce_bucket_size",
            "must be > 0",
        ),
        (
            {"zero_optimization": {"stage": 3, "sub_group_size": "99999999999999999999"}},
            "zero_optimization.sub_group_size",
            "out of range",
        ),
        ({"fp16": {"loss_scale": "inf"}}, "fp16.loss_scale", "finite"),
        ({"fp16": {"loss_scale": "nan"}}, "fp16.loss_scale", "finite"),
        ({"fp16": {"loss_scale": "-1"}}, "fp16.loss_scale", "must be >= 0"),
        ({"fp16": {"enabled": True, "loss_scale": "1e300"}}, "fp16.loss_scale", "must be <="),
        (
            {
                "zero_optimization": {
                    "stage": 2,
                    "offload_optimizer": {"device": "cpu", "ratio": "1.5"},
                }
            },
            "zero_optimization.offload_optimizer.ratio",
            "must be <= 1.0",
        ),
        (
            {
                "zero_optimization": {
                    "stage": 2,
                    "offload_optimizer": {"device": "cpu", "ratio": "nan"},
                }
            },
            "zero_optimization.offload_optimizer.ratio",
            "finite",
        ),
    ],
)
def test_converted_values_keep_the_range_checks(extra, key, fragment) -> None:
    lines = problems({**BASE, **extra})
    assert len(lines) == 1 and lines[0].startswith(f"{key}: ") and fragment in lines[0], lines


def test_booleans_stay_strict() -> None:
    # DeepSpeed's pydantic sections would also read "true" and 1 as true; a config that quotes a
    # flag is a typo here (deliberately stricter: only numbers are read from strings).
    for value in ("true", 1):
        (line,) = problems({**BASE, "fp16": {"enabled": value}})
        assert line.startswith("fp16.enabled: expected true or false")


# ---- 2. Hjson config files ------------------------------------------------------------------

HJSON_CONFIG = """\
// DeepSpeed reads config files with hjson.load
{
  train_micro_batch_size_per_gpu: 2,   # an unquoted key
  "optimizer": {
    "type": AdamW
    "params": {"lr": 1e-4, "betas": [0.9, 0.99,],},
  },
  /* a block comment */
  "zero_optimization": {
    "stage": 2,
    "reduce_bucket_size": 5e8,
    "offload_optimizer": {"device": "cpu",},
  },
}
"""


def test_hjson_file_with_comments_and_trailing_commas_loads(tmp_path: Path) -> None:
    pytest.importorskip("hjson")
    path = tmp_path / "ds_config.json"
    path.write_text(HJSON_CONFIG)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # valid Hjson: no repair warning, as in DeepSpeed
        cfg = load_config(path)
    assert cfg.train_micro_batch_size_per_gpu == 2 and cfg.optimizer is not None
    assert cfg.optimizer.type == "AdamW" and cfg.optimizer.params.lr == 1e-4
    assert cfg.optimizer.params.betas == (0.9, 0.99)
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert cfg.zero_optimization.offload


@pytest.mark.parametrize(
    "text, fragment",
    [
        ('{\n # c\n "train_batch_size": 2\n "a": 1\n "a": 2\n}', 'duplicate key "a"'),
        (
            '{\n # c\n "train_batch_size": 2,\n "b" 2\n}',
            "read as Hjson (as DeepSpeed reads config files): invalid at line 4 column 6",
        ),
        ('{\n # c\n "train_batch_size": 2\n "seed": 1e999\n}', "seed: expected a finite number"),
        (
            '{\n # c\n "train_batch_size": 2\n "zero_optimization": {"stagee": 2}\n}',
            'did you mean "stage"',
        ),
    ],
)
def test_hjson_file_errors(tmp_path: Path, text: str, fragment: str) -> None:
    pytest.importorskip("hjson")
    path = tmp_path / "c.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert fragment in str(info.value)


def test_with_hjson_json_files_keep_the_json_message_and_repair_warning(tmp_path: Path) -> None:
    pytest.importorskip("hjson")
    path = tmp_path / "c.json"
    path.write_text('{\n  "train_batch_size": 2,\n  "b" 2\n}')
    with pytest.raises(ConfigError, match=r"c\.json: invalid JSON at line 3 column 7: "):
        load_config(path)
    path.write_text('{\n  "train_batch_size": 2,\n}')  # a slip the repair names, as before
    with pytest.warns(UserWarning, match="repaired JSON: removed the trailing comma on line 2"):
        assert load_config(path).train_batch_size == 2


def test_without_hjson_files_keep_the_json_messages(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(json_text, "_hjson_module", lambda: None)
    path = tmp_path / "c.json"
    path.write_text('{\n  "train_batch_size": 2,\n  "b" 2\n}')
    with pytest.raises(ConfigError, match=r"c\.json: invalid JSON at line 3 column 7"):
        load_config(path)
    path.write_text('{\n  "train_batch_size": 2,\n}')
    with pytest.warns(UserWarning, match="repaired JSON: removed the trailing comma on line 2"):
        assert load_config(path).train_batch_size == 2
    path.write_text(HJSON_CONFIG)
    with pytest.raises(ConfigError, match="invalid JSON at line 1 column 1"):
        load_config(path)


def test_strict_json_file_reads_the_same_with_or_without_hjson(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({**BASE, "seed": 3, "zero_optimization": {"stage": 1}}))
    with_hjson = load_config(path)
    monkeypatch.setattr(json_text, "_hjson_module", lambda: None)
    assert load_config(path) == with_hjson


# ---- 3. deepscale_config and DeepSpeed's older key spellings --------------------------------


def _engine_config_file(tmp_path: Path) -> Path:
    from parity import engine_config

    path = tmp_path / "ds.json"
    cfg = engine_config(stage=2, offload=False, gas=1, micro=2, clip=1.0, overlap=False)
    path.write_text(json.dumps(cfg))
    return path


def test_initialize_reads_deepscale_config(tmp_path: Path, caplog) -> None:
    from parity import make_model

    path = _engine_config_file(tmp_path)
    args = argparse.Namespace(deepscale_config=str(path))  # no deepspeed_config attribute
    with caplog.at_level(logging.WARNING, logger="zero_offload"):
        engine, opt, _, _ = zero_offload.initialize(args=args, model=make_model())
    assert opt is not None and engine.train_micro_batch_size_per_gpu() == 2
    assert any("--deepscale_config is deprecated" in r.getMessage() for r in caplog.records)
    # Both given: DeepSpeed asserts; the error here is an AssertionError too.
    both = argparse.Namespace(deepspeed_config=str(path), deepscale_config=str(path))
    with pytest.raises(AssertionError, match="deepscale_config and --deepspeed_config"):
        zero_offload.initialize(args=both, model=make_model())


def test_deepspeed_config_without_deepscale_attribute_is_unchanged(tmp_path: Path) -> None:
    from parity import make_model

    path = _engine_config_file(tmp_path)
    args = argparse.Namespace(deepspeed_config=str(path), deepscale_config=None)
    engine, _, _, _ = zero_offload.initialize(args=args, model=make_model())
    assert engine.train_batch_size() == 2


def test_old_spellings_deepspeed_still_reads() -> None:
    # "bfloat16" is bf16; "zero_optimization": true is stage 1 with the top-level
    # "allgather_size" as its allgather bucket (DeepSpeed's read_zero_config_deprecated).
    cfg = quiet({**BASE, "bfloat16": {"enabled": True}})
    assert cfg.bf16.enabled
    cfg = quiet({**BASE, "zero_optimization": True, "allgather_size": 1000})
    assert cfg.zero_optimization.stage == 1
    assert cfg.zero_optimization.allgather_bucket_size == 1000
    assert "allgather_size" not in cfg.ignored_keys
    # With the current format DeepSpeed ignores "allgather_size" too: accepted, listed as
    # ignored, and not warned (it changes nothing DeepSpeed would do).
    cfg = quiet({**BASE, "zero_optimization": {"stage": 1}, "allgather_size": 1000})
    assert cfg.zero_optimization.allgather_bucket_size == 500_000_000
    assert "allgather_size" in cfg.ignored_keys
    # The stage-3 keys under DeepSpeed's field names, and the deprecated offload flags.
    cfg = quiet(
        {
            **BASE,
            "zero_optimization": {
                "stage": 3,
                "max_live_parameters": 10,
                "param_persistence_threshold": 5,
                "stage3_gather_fp16_weights_on_model_save": True,
                "cpu_offload": True,
            },
        }
    )
    zero = cfg.zero_optimization
    assert (zero.stage3_max_live_parameters, zero.stage3_param_persistence_threshold) == (10, 5)
    assert zero.stage3_gather_16bit_weights_on_model_save and zero.offload


# ---- 4. fp16 keys while fp16 is off (or the scale is static) --------------------------------

FP16_TEMPLATE = {
    "loss_scale": 0,
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "min_loss_scale": 1,
}


@pytest.mark.parametrize(
    "fp16",
    [
        {"enabled": False, **FP16_TEMPLATE},
        {"enabled": "auto", **FP16_TEMPLATE},  # Hugging Face's template, "auto" not filled
        {key: "auto" for key in ("enabled", *FP16_TEMPLATE)},
        # Values nothing reads while fp16 is off: DeepSpeed checks them only with dynamic scaling.
        {"enabled": False, "loss_scale_window": 0, "min_loss_scale": 0, "hysteresis": 0},
        {"enabled": False, "initial_scale_power": 100, "min_loss_scale": -1},
        {"enabled": False, "loss_scale": 1e30},
        # A static scale: the dynamic-scaling keys have no effect.
        {"enabled": True, "loss_scale": 128, "loss_scale_window": 0, "min_loss_scale": 0},
        {"enabled": True, "loss_scale": 128, "initial_scale_power": 100, "hysteresis": 0},
    ],
)
def test_fp16_keys_deepspeed_accepts_load(fp16: dict) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the "auto" defaults warning
        cfg = load_config({**BASE, "fp16": fp16})
    assert cfg.fp16.enabled == (fp16["enabled"] is True)
    assert quiet(cfg.to_dict()).to_dict() == cfg.to_dict()  # the resolved config loads again


@pytest.mark.parametrize(
    "fp16, key, fragment",
    [
        ({"loss_scale_window": 0}, "fp16.loss_scale_window", "must be >= 1 (got 0)"),
        ({"min_loss_scale": 0}, "fp16.min_loss_scale", "must be > 0.0 (got 0.0)"),
        ({"hysteresis": 0}, "fp16.hysteresis", "must be >= 1 (got 0)"),
        ({"initial_scale_power": 65}, "fp16.initial_scale_power", "must be <= 64 (got 65)"),
        ({"initial_scale_power": -1}, "fp16.initial_scale_power", "must be >= 0 (got -1)"),
        ({"initial_scale_power": True}, "fp16.initial_scale_power", "expected an integer"),
        ({"loss_scale_window": "x"}, "fp16.loss_scale_window", "expected an integer"),
    ],
)
def test_fp16_dynamic_scaling_keys_are_checked_when_they_act(fp16, key, fragment) -> None:
    lines = problems({**BASE, "fp16": {"enabled": True, "loss_scale": 0, **fp16}})
    assert len(lines) == 1 and lines[0].startswith(f"{key}: ") and fragment in lines[0], lines


def test_every_bad_fp16_key_is_reported() -> None:
    lines = problems(
        {
            **BASE,
            "fp16": {"enabled": True, "loss_scale_window": 0, "hysteresis": 0, "min_loss_scale": 0},
        }
    )
    assert sorted(line.split(":")[0] for line in lines) == [
        "fp16.hysteresis",
        "fp16.loss_scale_window",
        "fp16.min_loss_scale",
    ]


def test_fp16_types_are_checked_even_when_off() -> None:
    # DeepSpeed's pydantic model type-checks the block whether or not it is enabled.
    (line,) = problems({**BASE, "fp16": {"enabled": False, "hysteresis": "two"}})
    assert line.startswith("fp16.hysteresis: expected an integer")
    (line,) = problems({**BASE, "fp16": {"enabled": False, "loss_scale": -1}})
    assert line.startswith("fp16.loss_scale: must be >= 0")


@pytest.mark.parametrize("enabled", [True, False])
def test_bf16_block_with_deepspeed_keys_loads(enabled: bool) -> None:
    bf16 = {
        "enabled": enabled,
        "immediate_grad_update": False,
        "check_grad_overflow": True,
        "bf16_master_weights_and_grads": False,
        "bf16_optimizer_states": False,
    }
    cfg = quiet({**BASE, "zero_optimization": {"stage": 1}, "bf16": bf16})
    assert cfg.bf16.enabled is enabled


# ---- 5. exception classes -------------------------------------------------------------------

BAD_CONFIGS = [
    {"train_batch_size": 5, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2},
    {},  # no batch size
    {**BASE, "fp16": {"enabled": True}, "bf16": {"enabled": True}},
    {**BASE, "zero_optimization": {"stage": 4}},
    {**BASE, "fp16": {"loss_scal": 0}},
]


@pytest.mark.parametrize("config", BAD_CONFIGS)
def test_config_error_is_every_class_deepspeed_raises(config) -> None:
    with pytest.raises(ConfigError) as info:
        quiet(config)
    err = info.value
    assert isinstance(err, AssertionError)
    assert isinstance(err, zero_offload.config.DeepSpeedConfigError)
    assert isinstance(err, ValueError)
    with pytest.raises(DeepSpeedConfigError):
        quiet(config)
    try:
        quiet(config)
    except AssertionError as caught:  # a DeepSpeed script's `except AssertionError`
        assert caught.args == err.args
    # Still pickles (errors cross process boundaries in the launcher).
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is ConfigError and str(again) == str(err)


def test_deepspeed_config_error_is_exported() -> None:
    assert "DeepSpeedConfigError" in zero_offload.config.__all__
    assert issubclass(ConfigError, DeepSpeedConfigError) and issubclass(ConfigError, AssertionError)


# ---- 6. unknown keys stay errors ------------------------------------------------------------


def test_unknown_keys_stay_errors_with_a_suggestion() -> None:
    (line,) = problems({**BASE, "fp16": {"enabled": False, "loss_scal": 0}})
    assert line == 'unknown key "fp16.loss_scal"; did you mean "loss_scale"?'
    (line,) = problems({**BASE, "zero_optimization": {"reduce_bucket_sizes": "5"}})
    assert (
        line
        == 'unknown key "zero_optimization.reduce_bucket_sizes"; did you mean "reduce_bucket_size"?'
    )


# ---- DeepSpeed itself, when installed -------------------------------------------------------

_DS_SCRIPT = r"""
import json, logging, os, sys, warnings
os.environ.setdefault("DS_ACCELERATOR", "cpu")
logging.disable(logging.CRITICAL)
warnings.simplefilter("ignore")
from deepspeed.runtime.config import DeepSpeedConfig
out = []
for source in json.load(sys.stdin):
    try:
        c = DeepSpeedConfig(source)
        out.append({"ok": True, "gc": repr(c.gradient_clipping), "spp": repr(c.steps_per_print),
                    "opt": repr(c.optimizer_params), "sched": repr(c.scheduler_params)})
    except Exception as e:
        out.append({"ok": False, "mro": [k.__name__ for k in type(e).__mro__]})
print("RESULT" + json.dumps(out))
"""


def _deepspeed_verdicts(sources: list) -> list[dict]:
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    proc = subprocess.run(
        [sys.executable, "-c", _DS_SCRIPT],
        input=json.dumps(sources),
        capture_output=True,
        text=True,
        timeout=600,
    )
    line = next((s for s in proc.stdout.splitlines() if s.startswith("RESULT")), None)
    if line is None:
        pytest.skip(f"deepspeed does not import here: {proc.stderr[-500:]}")
    return json.loads(line[len("RESULT") :])


def test_deepspeed_agrees(tmp_path: Path) -> None:
    accepted = [{**BASE, **extra} for extra, _, _ in ACCEPTED_STRINGS]
    fp16_off = [
        {**BASE, "fp16": {"enabled": False, "loss_scale_window": 0, "min_loss_scale": 0}},
        {**BASE, "fp16": {"enabled": True, "loss_scale": 128, "loss_scale_window": 0}},
        {**BASE, "fp16": {"enabled": "auto", **FP16_TEMPLATE}},
    ]
    hjson_file = tmp_path / "ds.json"
    hjson_file.write_text(HJSON_CONFIG)
    refused = [config for config, _ in REFUSED_STRINGS]
    later = [config for config, _ in REFUSED_LATER_BY_DEEPSPEED]
    sources = [*accepted, *fp16_off, str(hjson_file), *refused, *later, *BAD_CONFIGS[:3]]
    verdicts = _deepspeed_verdicts(sources)
    n_ok = len(accepted) + len(fp16_off) + 1
    assert all(v["ok"] for v in verdicts[:n_ok]), [
        (s, v) for s, v in zip(sources, verdicts) if not v["ok"]
    ][:3]
    rest = verdicts[n_ok:]
    assert not any(v["ok"] for v in rest[: len(refused)]), list(zip(refused, rest))
    # Stored unconverted (strings), which DeepSpeed's engine then fails on.
    stored = rest[len(refused) : len(refused) + len(later)]
    assert [v["ok"] for v in stored] == [True] * len(later)
    assert stored[0]["gc"] == "'1.0'" and stored[1]["spp"] == "'10'"
    assert "'1e-3'" in stored[2]["opt"] and "'10'" in stored[3]["sched"]
    # The batch arithmetic and fp16 with bf16: DeepSpeed asserts.
    for verdict in rest[len(refused) + len(later) :]:
        assert not verdict["ok"] and "AssertionError" in verdict["mro"], verdict
