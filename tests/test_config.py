"""The DeepSpeed-style config: seed configs load, the batch triple resolves, bad input is named."""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import pytest
import torch

from zero_offload.config import (
    ConfigError,
    NotImplementedSettingWarning,
    ZeroOffloadConfig,
    load_config,
    parse_json_text,
)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"

# The seed snippets exactly as printed, with only the lost braces put back.

# ZeRO-Offload tutorial: DeepSpeed's own JSON, trailing comma and missing comma included.
SEED_000 = """{
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {
            "device": "cpu",
        }
        "contiguous_gradients": true,
        "overlap_comm": true
    }
}"""

# ZeRO-Offload blog example, brace lines restored as the JSON needs them ("}," where followed).
SEED_001 = """{
  "train_batch_size": "auto",
  "train_micro_batch_size_per_gpu": 4,
  "optimizer": {
    "type": "AdamW",
    "params": {
      "lr": 5e-5
    }
  },
  "zero_optimization": {
    "stage": 2,
    "offload_optimizer": {
      "device": "cpu",
      "pin_memory": true
    },
    "allgather_partitions": true,
    "allgather_bucket_size": 2e8,
    "reduce_scatter": true,
    "reduce_bucket_size": 2e8,
    "overlap_comm": true,
    "contiguous_gradients": true
  },
  "fp16": {
    "enabled": true
  },
  "gradient_clipping": 1.0
}"""

# The same with bare "}" lines: literally only braces restored, so four commas are missing.
SEED_001_BARE_BRACES = SEED_001.replace("},", "}")

# ZeRO tutorial, stage 1 and stage 2 snippets as printed (their "stage" lines were lost).
SEED_003_STAGE1 = """{
    "zero_optimization": {
        "reduce_bucket_size": 5e8
    }
}"""
SEED_003_STAGE2 = """{
    "zero_optimization": {
        "contiguous_gradients": true,
        "overlap_comm": true,
        "reduce_scatter": true,
        "reduce_bucket_size": 5e8,
        "allgather_bucket_size": 5e8
    }
}"""


def problems(config: dict, world_size: int = 1, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(config, world_size, **kwargs)
    return str(info.value)


def quiet_load(source, world_size: int = 1, **kwargs) -> ZeroOffloadConfig:
    """load_config asserting it emits no warning at all."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(source, world_size, **kwargs)
    assert [str(w.message) for w in caught] == []
    return cfg


# ---- seed configs ---------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2])
def test_seed_zero_offload_config_file(world_size: int) -> None:
    with pytest.warns(UserWarning) as record:
        cfg = load_config(CONFIGS / "ds_zero_offload.config", world_size, micro_batch_size=10)
    assert len(record) == 1
    message = str(record[0].message)
    assert "line 5" in message and "line 6" in message
    z = cfg.zero_optimization
    assert (z.stage, z.offload_device, z.offload) == (2, "cpu", True)
    assert z.contiguous_gradients and z.overlap_comm
    assert z.reduce_bucket_size == z.allgather_bucket_size == 500_000_000
    assert not cfg.fp16.enabled and cfg.dtype == torch.float32
    assert cfg.optimizer is None and cfg.scheduler is None
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (10, 1)
    assert cfg.train_batch_size == 10 * world_size


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize(
    "name, stage, overlap",
    [("ds_zero_stage_1.config", 1, False), ("ds_zero_stage_2.config", 2, True)],
)
def test_seed_zero_stage_config_files(
    world_size: int, name: str, stage: int, overlap: bool
) -> None:
    cfg = quiet_load(CONFIGS / name, world_size, micro_batch_size=1)
    z = cfg.zero_optimization
    assert (z.stage, z.offload_device, z.overlap_comm) == (stage, "none", overlap)
    assert z.reduce_bucket_size == 500_000_000 and isinstance(z.reduce_bucket_size, int)
    assert z.allgather_bucket_size == 500_000_000
    assert cfg.train_batch_size == world_size and not cfg.fp16.enabled


@pytest.mark.parametrize("world_size", [1, 2])
def test_seed_offload_fp16_adamw_file(world_size: int) -> None:
    cfg = quiet_load(CONFIGS / "ds_offload_fp16_adamw.json", world_size)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu) == (4 * world_size, 4)
    assert cfg.gradient_accumulation_steps == 1
    assert cfg.optimizer is not None and cfg.optimizer.type == "AdamW" and cfg.optimizer.adamw
    assert cfg.optimizer.params.lr == 5e-5
    z = cfg.zero_optimization
    assert (z.stage, z.offload_device) == (2, "cpu")
    assert z.offload_optimizer is not None and z.offload_optimizer.pin_memory
    assert z.reduce_bucket_size == z.allgather_bucket_size == 200_000_000
    assert z.overlap_comm and z.contiguous_gradients and z.reduce_scatter and z.allgather_partitions
    assert cfg.fp16.enabled and cfg.dtype == torch.float16 and cfg.fp16.dynamic_loss_scale
    assert cfg.gradient_clipping == 1.0


@pytest.mark.parametrize("name", ["ds_zero_offload.config", "ds_zero_stage_1.config"])
def test_tutorial_configs_need_a_batch_size(name: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with pytest.raises(ConfigError) as info:
            load_config(CONFIGS / name, 1)
    assert "train_batch_size" in str(info.value)
    assert "train_micro_batch_size_per_gpu" in str(info.value)


def test_seed_000_snippet_as_printed() -> None:
    with pytest.warns(UserWarning) as record:
        raw = parse_json_text(SEED_000, origin="seed")
    assert len(record) == 1
    assert "trailing comma on line 5" in str(record[0].message)
    assert "end of line 6" in str(record[0].message)
    cfg = quiet_load(raw, 1, micro_batch_size=10)
    assert cfg.zero_optimization.stage == 2 and cfg.zero_optimization.offload


@pytest.mark.parametrize("world_size", [1, 2])
def test_seed_001_snippet_as_printed(world_size: int) -> None:
    strict = quiet_load(json.loads(SEED_001), world_size)
    with pytest.warns(UserWarning) as record:
        bare = parse_json_text(SEED_001_BARE_BRACES, origin="seed")
    assert len(record) == 1 and str(record[0].message).count("missing comma") == 4
    assert quiet_load(bare, world_size) == strict
    assert strict.train_batch_size == 4 * world_size
    assert strict.zero_optimization.reduce_bucket_size == 200_000_000
    assert strict.fp16.enabled and strict.zero_optimization.offload_device == "cpu"


def test_seed_003_snippets_as_printed_have_no_stage() -> None:
    stage1 = quiet_load(json.loads(SEED_003_STAGE1), 2, micro_batch_size=1)
    stage2 = quiet_load(json.loads(SEED_003_STAGE2), 2, micro_batch_size=1)
    # Without the lost "stage" lines both snippets mean stage 0, DeepSpeed's default.
    assert stage1.zero_optimization.stage == 0 and stage2.zero_optimization.stage == 0
    assert stage1.zero_optimization.reduce_bucket_size == 500_000_000
    assert stage2.zero_optimization.overlap_comm and stage2.zero_optimization.reduce_scatter


# ---- batch triple ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "given, world_size, expected",
    [
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
        ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 2, (32, 8, 2)),
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 2, (16, 4, 2)),
        ({"train_batch_size": 32}, 2, (32, 16, 1)),
        ({"train_micro_batch_size_per_gpu": 4}, 3, (12, 4, 1)),
        (
            {
                "train_batch_size": 16,
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 2,
            },
            2,
            (16, 4, 2),
        ),
        ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4}, 2, (8, 4, 1)),
        (
            {
                "train_batch_size": "auto",
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": "auto",
            },
            3,
            (12, 4, 1),
        ),
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": "auto"}, 4, (32, 8, 1)),
        ({"train_batch_size": 3.2e1, "gradient_accumulation_steps": 4.0}, 1, (32, 8, 4)),
    ],
)
def test_batch_triple_resolves(given: dict, world_size: int, expected: tuple) -> None:
    cfg = quiet_load(given, world_size)
    got = (
        cfg.train_batch_size,
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
    )
    assert got == expected and all(type(v) is int for v in got)
    assert cfg.world_size == world_size


def test_inconsistent_triple_shows_the_arithmetic() -> None:
    given = {
        "train_batch_size": 32,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
    }
    assert (
        "train_batch_size 32 != train_micro_batch_size_per_gpu 4 * "
        "gradient_accumulation_steps 2 * world_size 2 = 16" in problems(given, 2)
    )


def test_derived_value_that_does_not_divide_is_named() -> None:
    text = problems({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, 2)
    assert "train_batch_size 30 != train_micro_batch_size_per_gpu 4 * " in text
    assert "gradient_accumulation_steps derived as 30 // (4 * 2) = 3" in text


def test_batch_smaller_than_world_size() -> None:
    text = problems({"train_batch_size": 2}, 4)
    assert "train_micro_batch_size_per_gpu derived as 2 // (1 * 4) = 0" in text


@pytest.mark.parametrize(
    "given", [{}, {"gradient_accumulation_steps": 4}, {"train_batch_size": "auto"}]
)
def test_no_batch_size_is_an_error(given: dict) -> None:
    text = problems(given)
    assert "no batch size given" in text and "train_micro_batch_size_per_gpu" in text


def test_micro_batch_size_argument_fills_and_must_agree() -> None:
    cfg = quiet_load({"train_micro_batch_size_per_gpu": "auto"}, 2, micro_batch_size=3)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu) == (6, 3)
    text = problems({"train_micro_batch_size_per_gpu": 4}, 2, micro_batch_size=3)
    assert "train_micro_batch_size_per_gpu 4 in the config != micro_batch_size 3" in text


@pytest.mark.parametrize("value, fragment", [(0, "must be > 0"), (True, "expected an integer")])
def test_batch_values_are_checked(value: object, fragment: str) -> None:
    text = problems({"train_micro_batch_size_per_gpu": value})
    assert f"train_micro_batch_size_per_gpu: {fragment}" in text


@pytest.mark.parametrize("world_size", [0, -1, 1.5, True])
def test_world_size_must_be_positive(world_size: object) -> None:
    with pytest.raises(ConfigError, match="world_size"):
        load_config({"train_batch_size": 4}, world_size)  # type: ignore[arg-type]


# ---- defaults and typed values --------------------------------------------------------------


def test_defaults_are_deepspeeds() -> None:
    cfg = quiet_load({"train_micro_batch_size_per_gpu": 1})
    fp16 = cfg.fp16
    assert (fp16.enabled, fp16.auto_cast, fp16.loss_scale, fp16.initial_scale_power) == (
        False,
        False,
        0.0,
        16,
    )
    assert (fp16.loss_scale_window, fp16.hysteresis, fp16.consecutive_hysteresis) == (
        1000,
        2,
        False,
    )
    assert fp16.min_loss_scale == 1.0 and not cfg.bf16.enabled
    z = cfg.zero_optimization
    assert z.stage == 0 and z.contiguous_gradients and z.reduce_scatter and z.allgather_partitions
    assert (
        z.overlap_comm is False and z.reduce_bucket_size == z.allgather_bucket_size == 500_000_000
    )
    assert z.load_from_fp32_weights and z.ignore_unused_parameters and not z.round_robin_gradients
    assert not z.elastic_checkpoint and z.offload_optimizer is None and z.offload_device == "none"
    # DeepSpeed's current defaults: clipping at 1.0, no periodic step log.
    assert (cfg.gradient_clipping, cfg.steps_per_print, cfg.wall_clock_breakdown) == (
        1.0,
        None,
        False,
    )
    assert (cfg.seed, cfg.prescale_gradients, cfg.gradient_predivide_factor) == (None, False, 1.0)
    assert cfg.optimizer is None and cfg.scheduler is None and cfg.dtype == torch.float32


def test_offload_and_adam_defaults() -> None:
    cfg = quiet_load(
        {
            "train_batch_size": 2,
            "optimizer": {"type": "adam"},
            "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
        }
    )
    off = cfg.zero_optimization.offload_optimizer
    assert off is not None
    assert (off.pin_memory, off.buffer_count, off.fast_init, off.ratio) == (True, 4, False, 1.0)
    assert (off.pipeline_read, off.pipeline_write, off.nvme_path) == (False, False, None)
    assert (off.delayed_update, off.delayed_update_after, off.threads) == (False, 0, None)
    assert cfg.optimizer is not None
    p = cfg.optimizer.params
    assert cfg.optimizer.type == "Adam" and (p.lr, p.betas, p.eps) == (1e-3, (0.9, 0.999), 1e-8)
    assert (p.weight_decay, p.bias_correction, p.adam_w_mode, p.torch_adam) == (
        0.0,
        True,
        True,
        False,
    )


@pytest.mark.parametrize(
    "optimizer, adamw",
    [
        ({"type": "Adam"}, True),
        ({"type": "ADAM", "params": {"adam_w_mode": False}}, False),
        ({"type": "adamw", "params": {"adam_w_mode": False}}, True),
        ({"type": "AdamW", "params": {"torch_adam": True, "weight_decay": 0.1}}, True),
    ],
)
def test_adam_w_mode_follows_deepspeed(optimizer: dict, adamw: bool) -> None:
    cfg = quiet_load({"train_batch_size": 1, "optimizer": optimizer})
    assert cfg.optimizer is not None and cfg.optimizer.adamw is adamw
    assert cfg.optimizer.type in ("Adam", "AdamW")


def test_dtype_follows_precision_sections() -> None:
    assert quiet_load({"train_batch_size": 1, "bf16": {"enabled": True}}).dtype == torch.bfloat16
    old_key = quiet_load({"train_batch_size": 1, "bfloat16": {"enabled": True}})
    assert old_key.bf16.enabled and old_key.dtype == torch.bfloat16
    assert quiet_load({"train_batch_size": 1, "fp16": {"enabled": True}}).dtype == torch.float16


def test_extension_keys_and_seed() -> None:
    cfg = quiet_load(
        {
            "train_batch_size": 1,
            "seed": 1234,
            "zero_optimization": {
                "stage": 2,
                "offload_optimizer": {
                    "device": "cpu",
                    "delayed_update": True,
                    "delayed_update_after": 5,
                    "threads": 3,
                },
            },
        }
    )
    off = cfg.zero_optimization.offload_optimizer
    assert cfg.seed == 1234 and off is not None
    assert (off.delayed_update, off.delayed_update_after, off.threads) == (True, 5, 3)


def test_legacy_cpu_offload_and_zero_bool() -> None:
    cfg = quiet_load(
        {"train_batch_size": 1, "zero_optimization": {"stage": 2, "cpu_offload": True}}
    )
    assert cfg.zero_optimization.offload_device == "cpu"
    assert (
        quiet_load({"train_batch_size": 1, "zero_optimization": True}).zero_optimization.stage == 1
    )


def test_auto_means_default() -> None:
    with pytest.warns(UserWarning, match='"auto" has nothing to fill it'):
        cfg = load_config(
            {
                "train_batch_size": 1,
                "gradient_clipping": "auto",
                "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
                "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
            }
        )
    assert cfg.gradient_clipping == 1.0 and cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert cfg.optimizer is not None and cfg.optimizer.params.lr == 1e-3
    text = problems(
        {
            "train_batch_size": 1,
            "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}},
        }
    )
    assert "scheduler.params.total_num_steps: required" in text and '"auto"' in text


def test_scheduler_params_are_typed_per_type() -> None:
    cfg = quiet_load(
        {
            "train_batch_size": 1,
            "scheduler": {
                "type": "warmupcosinelr",
                "params": {"total_num_steps": 1e3, "warmup_num_steps": 10},
            },
        }
    )
    assert cfg.scheduler is not None and cfg.scheduler.type == "WarmupCosineLR"
    params = cfg.scheduler.params
    assert (params.total_num_steps, params.warmup_num_steps, params.cos_min_ratio) == (
        1000,
        10,
        1e-4,
    )
    warm = quiet_load({"train_batch_size": 1, "scheduler": {"type": "WarmupLR"}}).scheduler
    assert warm is not None and warm.params.warmup_max_lr is None
    assert warm.params.warmup_type == "log"


def test_to_dict_round_trips() -> None:
    cfg = quiet_load(json.loads(SEED_001), 2)
    as_dict = cfg.to_dict()
    assert json.loads(json.dumps(as_dict)) == as_dict
    assert quiet_load(as_dict, 2).to_dict() == as_dict
    assert as_dict["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_config_object_source_is_reresolved_for_a_new_world_size() -> None:
    source = {"train_micro_batch_size_per_gpu": 4}
    before = copy.deepcopy(source)
    cfg = quiet_load(source, 1)
    assert source == before  # the caller's dict is not modified
    assert load_config(cfg, 1) is cfg
    again = quiet_load(cfg, 2)
    assert (again.train_batch_size, again.world_size) == (8, 2)


# ---- bad input: every message names the key ----------------------------------------------------


@pytest.mark.parametrize(
    "config, expected",
    [
        (
            {"train_batch_size": 1, "trian_micro_batch_size_per_gpu": 1},
            'unknown key "trian_micro_batch_size_per_gpu"; did you mean '
            '"train_micro_batch_size_per_gpu"?',
        ),
        (
            {"train_batch_size": 1, "activation_checkpointin": {}},
            'unknown key "activation_checkpointin"; did you mean "activation_checkpointing"?',
        ),
        (
            {"train_batch_size": 1, "zero_optimization": {"reduce_bucket_sise": 5}},
            'unknown key "zero_optimization.reduce_bucket_sise"; did you mean "reduce_bucket_size"?',
        ),
        (
            {
                "train_batch_size": 1,
                "zero_optimization": {"stage": 1, "offload_optimizer": {"pin_memmory": True}},
            },
            'unknown key "zero_optimization.offload_optimizer.pin_memmory"; '
            'did you mean "pin_memory"?',
        ),
        (
            {
                "train_batch_size": 1,
                "scheduler": {"type": "WarmupLR", "params": {"warmup_steps": 5}},
            },
            'unknown key "scheduler.params.warmup_steps"; did you mean "warmup_num_steps"?',
        ),
        (
            {"train_batch_size": 1, "optimizer": {"type": "Adam", "params": {"max_grad_norm": 1}}},
            'unknown key "optimizer.params.max_grad_norm": not an optimizer parameter; '
            'use the top-level "gradient_clipping"',
        ),
        (
            {"train_batch_size": 1, "fp16": {"zzz": 1}},
            'unknown key "fp16.zzz"; valid keys here: auto_cast, consecutive_hysteresis',
        ),
        (
            {"train_batch_size": 1, "zero_optimization": {"overlap_comm": 1}},
            "zero_optimization.overlap_comm: expected true or false, got 1",
        ),
        (
            {"train_batch_size": 1, "zero_optimization": {"reduce_bucket_size": 2.5}},
            "zero_optimization.reduce_bucket_size: expected an integer, got 2.5",
        ),
        (
            {"train_batch_size": 1, "zero_optimization": {"reduce_bucket_size": "5e8"}},
            'zero_optimization.reduce_bucket_size: expected an integer, got "5e8"',
        ),
        ({"train_batch_size": 1, "fp16": True}, "fp16: must be a JSON object (got true)"),
        ({"train_batch_size": 1, "gradient_clipping": -1}, "gradient_clipping: must be >= 0.0"),
        ({"train_batch_size": 1, "steps_per_print": 0}, "steps_per_print: must be >= 1"),
        (
            {"train_batch_size": 1, "optimizer": {"type": "Adam", "params": {"betas": [0.9, 1.5]}}},
            "optimizer.params.betas[1]: must be < 1.0 (got 1.5)",
        ),
        (
            {"train_batch_size": 1, "zero_optimization": {"stage": 5}},
            "zero_optimization.stage: allowed: 0, 1, 2, 3; got 5",
        ),
        (
            {
                "train_batch_size": 1,
                "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}},
            },
            'zero_optimization.offload_optimizer.nvme_path: required with device "nvme": must be '
            "a local directory",
        ),
        (
            {
                "train_batch_size": 1,
                "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "gpu"}},
            },
            'zero_optimization.offload_optimizer.device: allowed: "none", "cpu", "nvme"; got "gpu"',
        ),
        (
            {"train_batch_size": 1, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
            'zero_optimization.offload_optimizer.device: "cpu" needs zero_optimization.stage 1, 2 '
            "or 3 (stage is 0)",
        ),
        (
            {"train_batch_size": 1, "zero_optimization": {"cpu_offload": True}},
            'zero_optimization.offload_optimizer.device: "cpu" needs zero_optimization.stage 1, 2 '
            "or 3",
        ),
        (
            {
                "train_batch_size": 1,
                "zero_optimization": {
                    "stage": 2,
                    "cpu_offload": True,
                    "offload_optimizer": {"device": "cpu"},
                },
            },
            "zero_optimization.cpu_offload: deprecated alias of offload_optimizer",
        ),
        (
            {
                "train_batch_size": 1,
                "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}},
            },
            'zero_optimization.offload_param.device: "cpu" parameter offload needs '
            "zero_optimization.stage 3 (stage is 2)",
        ),
        (
            {
                "train_batch_size": 1,
                "zero_optimization": {
                    "stage": 2,
                    "offload_optimizer": {"device": "cpu", "ratio": 0.5},
                },
            },
            "zero_optimization.offload_optimizer.ratio: partial offload",
        ),
        (
            {
                "train_batch_size": 1,
                "zero_optimization": {"stage": 2, "offload_optimizer": {"threads": 0}},
            },
            "zero_optimization.offload_optimizer.threads: must be >= 1",
        ),
        (
            {"train_batch_size": 1, "fp16": {"enabled": True}, "bf16": {"enabled": True}},
            "bf16.enabled: fp16.enabled and bf16.enabled are both true; pick one",
        ),
        (
            {"train_batch_size": 1, "fp16": {"enabled": True}, "bfloat16": {"enabled": True}},
            "bf16.enabled: fp16.enabled and bf16.enabled are both true; pick one",
        ),
        (
            {"train_batch_size": 1, "optimizer": {"type": "Lamb", "params": {"max_coeff": 10.0}}},
            'optimizer.type: optimizer "Lamb" is not supported; supported types: Adam, AdamW',
        ),
        (
            {"train_batch_size": 1, "optimizer": {"params": {"lr": 0.1}}},
            "optimizer.type: required",
        ),
        (
            {"train_batch_size": 1, "optimizer": {"type": "Adam", "params": {"amsgrad": True}}},
            "optimizer.params.amsgrad: amsgrad is not supported",
        ),
        (
            {"train_batch_size": 1, "scheduler": {"type": "OneCycle"}},
            'scheduler.type: "OneCycle" is not built; supported types: WarmupLR, WarmupDecayLR',
        ),
        (
            {"train_batch_size": 1, "scheduler": {"type": "WarmupCosine"}},
            'scheduler.type: "WarmupCosine" is not supported; supported types: WarmupLR, '
            'WarmupDecayLR, WarmupCosineLR; did you mean "WarmupCosineLR"?',
        ),
        (
            {"train_batch_size": 1, "scheduler": {"type": "WarmupDecayLR"}},
            "scheduler.params.total_num_steps: required",
        ),
        (
            {
                "train_batch_size": 1,
                "scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}},
            },
            "scheduler.params.warmup_type: allowed: 'log' or 'linear' (got \"cosine\")",
        ),
        (
            {
                "train_batch_size": 1,
                "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": [0.1, "x"]}},
            },
            "scheduler.params.warmup_max_lr: expected a number or a list of numbers",
        ),
    ],
)
def test_bad_input_names_the_key(config: dict, expected: str) -> None:
    text = problems(config)
    assert expected in text, text
    # One problem, one line: an unsupported optimizer's params are not also reported.
    assert len(text.splitlines()) == 2, text


def test_all_problems_are_reported_together() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(
            {
                "train_batch_size": 1,
                "stepz_per_print": 3,
                "zero_optimization": {"stage": 4, "overlap_com": True},
                "fp16": {"loss_scale": -1},
            }
        )
    lines = info.value.problems
    assert len(lines) == 4
    assert str(info.value).count("\n") == 4
    assert isinstance(info.value, ValueError)


# ---- accepted but not implemented -----------------------------------------------------------------


def test_not_implemented_keys_give_exactly_one_warning() -> None:
    config = {
        "train_batch_size": 1,
        "flops_profiler": {"enabled": False},
        "wandb": {"enabled": False},
        "communication_data_type": "fp16",
        "prescale_gradients": True,
        "gradient_predivide_factor": 2.0,
        "fp16": {"enabled": True, "fused_mode": True},
        "optimizer": {"type": "AdamW", "params": {"set_grad_none": True}},
        "zero_optimization": {
            "stage": 2,
            "sub_group_size": 1e8,
            "stage3_max_live_parameters": 2e8,
            "stage3_module_granularity_threshold": 100,
        },
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(config)
    assert len(caught) == 1
    assert issubclass(caught[0].category, NotImplementedSettingWarning)
    message = str(caught[0].message)
    assert message.startswith("<dict>: DeepSpeed settings accepted but not built here")
    for key in (
        'communication_data_type="fp16" (gradients are reduced in the gradient dtype',
        "zero_optimization.sub_group_size=100000000 (stage 3 only)",
        "zero_optimization.stage3_max_live_parameters=200000000 (stage 3 only)",
        "prescale_gradients=true (gradients are averaged after the reduction, not before)",
        "gradient_predivide_factor=2.0",
    ):
        assert key in message, key
    # Off values, and keys that change only speed or logging, are not warned; still ignored.
    for key in ("flops_profiler", "wandb", "fused_mode", "set_grad_none", "granularity"):
        assert key not in message, key
    assert "zero_optimization.stage3_module_granularity_threshold" in cfg.ignored_keys
    assert "wandb" in cfg.ignored_keys
    assert "zero_optimization.sub_group_size" not in cfg.ignored_keys  # typed: stage 3 reads it
    assert "prescale_gradients" not in cfg.ignored_keys  # a typed key, warned for its value only


def test_default_values_of_partly_implemented_keys_do_not_warn() -> None:
    quiet_load({"train_batch_size": 1, "prescale_gradients": False, "gradient_predivide_factor": 1})


# ---- lenient JSON ---------------------------------------------------------------------------------


def test_lenient_json_repairs_only_outside_strings() -> None:
    text = '{\n  "a": [1, 2,],\n  "b": "x,}"\n  "c": {"d": true,},\n}'
    with pytest.warns(UserWarning) as record:
        data = parse_json_text(text, origin="t.json")
    assert data == {"a": [1, 2], "b": "x,}", "c": {"d": True}}
    assert len(record) == 1
    message = str(record[0].message)
    assert message.startswith("t.json: repaired JSON")
    assert "line 2" in message and "end of line 3" in message and "line 4" in message


def test_valid_json_is_read_without_warning() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert parse_json_text('{"a": "b,]"}') == {"a": "b,]"}
    assert caught == []


@pytest.mark.parametrize(
    "text, fragment",
    [
        ('{\n  "a": [1\n  2]\n}', "line 3"),  # a missing comma that is not before a key
        ('{\n  "a": 1,\n  "b" 2\n}', "line 3"),
        ("[1, 2]", "must be a JSON object"),
        ('{"a": NaN}', "NaN"),
        ('{"a": 1, "a": 2}', 'duplicate key "a"'),
    ],
)
def test_bad_json_is_a_config_error(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_json_text(text, origin="bad.json")
    assert fragment in str(info.value)


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.json")
    path = tmp_path / "cfg.json"
    path.write_text('{"train_batch_size": 2, "zero_optimization": {"stage": 4}}')
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert str(path) in str(info.value) and "zero_optimization.stage" in str(info.value)
    with pytest.raises(ConfigError, match="JSON file path, a dict or a ZeroOffloadConfig"):
        load_config(42)  # type: ignore[arg-type]
