"""Stage 3 config: DeepSpeed's stage-3 keys, spellings and defaults, ``offload_param``, the rules
between them, and ``"auto"`` sizes filled from the model's hidden size."""

from __future__ import annotations

import json
import logging
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from zero_offload.config import (
    ConfigError,
    NotImplementedSettingWarning,
    ZeroOffloadConfig,
    load_config,
    resolve_auto_sizes,
)
from zero_offload.config.zero.zero_optimization import ZERO_NOT_IMPLEMENTED

CONFIGS = Path(__file__).resolve().parents[1] / "configs"

# (field / canonical key, other spellings DeepSpeed accepts, DeepSpeed's default)
STAGE3_KEYS = [
    ("stage3_prefetch_bucket_size", ["prefetch_bucket_size"], 50_000_000),
    ("stage3_param_persistence_threshold", ["param_persistence_threshold"], 100_000),
    ("stage3_model_persistence_threshold", ["model_persistence_threshold"], sys.maxsize),
    ("stage3_max_live_parameters", ["max_live_parameters"], 1_000_000_000),
    ("stage3_max_reuse_distance", ["max_reuse_distance"], 1_000_000_000),
    (
        "stage3_gather_16bit_weights_on_model_save",
        ["gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save"],
        False,
    ),
    ("sub_group_size", [], 1_000_000_000),
]
INT_KEYS = [name for name, _, default in STAGE3_KEYS if not isinstance(default, bool)]


def load(zero: dict, world_size: int = 1) -> ZeroOffloadConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("error", NotImplementedSettingWarning)
        return load_config({"train_batch_size": world_size, "zero_optimization": zero}, world_size)


def problems(zero: dict) -> str:
    with pytest.raises(ConfigError) as info:
        load_config({"train_batch_size": 1, "zero_optimization": zero})
    assert len(info.value.problems) == 1, info.value.problems
    return info.value.problems[0]


# ---- keys, spellings, defaults ---------------------------------------------------------------------


def test_stage3_defaults_are_deepspeeds() -> None:
    zc = load({"stage": 3}).zero_optimization
    assert zc.stage == 3
    for name, _, default in STAGE3_KEYS:
        assert getattr(zc, name) == default, name
    assert zc.overlap_comm is True  # DeepSpeed: on by default at stage 3 only
    assert (zc.offload_param_device, zc.offload_params) == ("none", False)
    assert (zc.offload_device, zc.offload) == ("none", False)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_overlap_comm_defaults_off_below_stage3(stage: int) -> None:
    assert load({"stage": stage}).zero_optimization.overlap_comm is False


def test_overlap_comm_explicit_false_at_stage3() -> None:
    assert load({"stage": 3, "overlap_comm": False}).zero_optimization.overlap_comm is False


@pytest.mark.parametrize(("name", "aliases", "default"), STAGE3_KEYS)
def test_every_spelling_sets_the_field(name: str, aliases: list[str], default: object) -> None:
    value = True if isinstance(default, bool) else 12_345
    for key in (name, *aliases):
        zc = load({"stage": 3, key: value}).zero_optimization
        assert getattr(zc, name) == value, key
        # to_dict() holds the canonical spelling only, and loads back to the same config
        dumped = zc.model_dump(mode="json")
        assert dumped[name] == value and not set(aliases) & set(dumped)


def test_float_written_sizes_are_ints() -> None:
    zc = load({"stage": 3, "stage3_prefetch_bucket_size": 5e8, "sub_group_size": 1e9})
    assert zc.zero_optimization.stage3_prefetch_bucket_size == 500_000_000
    assert isinstance(zc.zero_optimization.sub_group_size, int)


@pytest.mark.parametrize(("name", "aliases", "default"), [k for k in STAGE3_KEYS if k[1]])
def test_two_spellings_of_one_setting_are_an_error(
    name: str, aliases: list[str], default: object
) -> None:
    value = True if isinstance(default, bool) else 7
    text = problems({"stage": 3, name: value, aliases[-1]: value})
    assert text.startswith(f"zero_optimization.{name}: ")
    assert f'"{aliases[-1]}" is the same setting' in text and "give one, not both" in text


@pytest.mark.parametrize("name", INT_KEYS)
@pytest.mark.parametrize(
    ("value", "message"),
    [(-1, "must be >= 0 (got -1)"), (2.5, "expected an integer, got 2.5"), (True, "got true")],
)
def test_bad_sizes_name_the_key(name: str, value: object, message: str) -> None:
    if name == "sub_group_size" and value == -1:  # 0 is refused too: the update's chunk size
        message = "must be > 0 (got -1)"
    text = problems({"stage": 3, name: value})
    assert text.startswith(f"zero_optimization.{name}: ") and message in text, text


@pytest.mark.parametrize(
    "key",
    [
        "prefetch_bucket_size",
        "max_live_parameters",
        "gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save",
    ],
)
def test_bad_value_under_an_alias_names_the_alias(key: str) -> None:
    text = problems({"stage": 3, key: "x"})
    assert text.startswith(f"zero_optimization.{key}: expected"), text


def test_bool_key_rejects_numbers() -> None:
    text = problems({"stage": 3, "stage3_gather_16bit_weights_on_model_save": 1})
    assert text == (
        "zero_optimization.stage3_gather_16bit_weights_on_model_save: expected true or false, got 1"
    )


def test_implemented_keys_left_the_not_implemented_list() -> None:
    for name, aliases, _ in STAGE3_KEYS:
        for key in (name, *aliases):
            assert key not in ZERO_NOT_IMPLEMENTED, key
    assert "cpu_offload_param" not in ZERO_NOT_IMPLEMENTED


def test_stage3_extras_still_warn_once() -> None:
    extras = {
        "stage3_module_granularity_threshold": 100,
        "use_all_reduce_for_fetch_params": True,
        "zero_quantized_weights": True,
        "zero_hpz_partition_size": 8,
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(
            {
                "train_batch_size": 1,
                "zero_optimization": {"stage": 3, "sub_group_size": 1e8, **extras},
            }
        )
    assert len(caught) == 1 and issubclass(caught[0].category, NotImplementedSettingWarning)
    message = str(caught[0].message)
    for key in extras:
        assert f"zero_optimization.{key}" in cfg.ignored_keys
    # Warned: what changes training (what differs is said); speed-only keys are not.
    assert "zero_optimization.zero_quantized_weights=true (params are gathered unquantized)" in (
        message
    )
    assert "zero_optimization.zero_hpz_partition_size=8" in message
    assert "granularity" not in message and "use_all_reduce" not in message
    assert "sub_group_size" not in message  # read at stage 3


def test_stage3_values_below_stage3_warn_as_no_effect() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(
            {
                "train_batch_size": 1,
                "zero_optimization": {
                    "stage": 2,
                    "max_live_parameters": 3e8,  # not the default: no effect at stage 2
                    "stage3_prefetch_bucket_size": 5e7,  # the default: nothing to say
                },
            }
        )
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "zero_optimization.stage3_max_live_parameters=300000000 (stage 3 only)" in message
    assert "prefetch" not in message


# ---- offload_param --------------------------------------------------------------------------------


def test_offload_param_cpu_at_stage3() -> None:
    zc = load(
        {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}
    ).zero_optimization
    assert (zc.offload_param_device, zc.offload_params) == ("cpu", True)
    assert zc.offload and zc.offload_device == "cpu"
    op = zc.offload_param
    assert op is not None
    assert (op.pin_memory, op.buffer_count, op.buffer_size, op.max_in_cpu) == (
        True,
        5,
        100_000_000,
        1_000_000_000,
    )


def test_offload_param_alone_at_stage3() -> None:
    zc = load({"stage": 3, "offload_param": {"device": "cpu", "pin_memory": False}})
    zc3 = zc.zero_optimization
    assert zc3.offload_params and not zc3.offload
    assert zc3.offload_param is not None and zc3.offload_param.pin_memory is False


def test_offload_param_none_is_fine_at_any_stage() -> None:
    zc = load({"stage": 1, "offload_param": {"device": "none"}}).zero_optimization
    assert (zc.offload_param_device, zc.offload_params) == ("none", False)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_offload_param_cpu_needs_stage3(stage: int) -> None:
    text = problems({"stage": stage, "offload_param": {"device": "cpu"}})
    assert text.startswith('zero_optimization.offload_param.device: "cpu" parameter offload')
    assert f"needs zero_optimization.stage 3 (stage is {stage})" in text


def test_offload_param_nvme_at_stage3() -> None:
    zc = load({"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x"}})
    zc3 = zc.zero_optimization
    assert (zc3.offload_param_device, zc3.offload_params, zc3.param_nvme_path) == (
        "nvme",
        True,
        "/x",
    )
    text = problems({"stage": 2, "offload_param": {"device": "nvme", "nvme_path": "/x"}})
    assert text.startswith('zero_optimization.offload_param.device: "nvme" parameter offload')


def test_offload_param_bad_device_and_sizes() -> None:
    assert problems({"stage": 3, "offload_param": {"device": "gpu"}}) == (
        'zero_optimization.offload_param.device: allowed: "none", "cpu", "nvme"; got "gpu"'
    )
    for key in ("buffer_count", "buffer_size", "max_in_cpu"):
        text = problems({"stage": 3, "offload_param": {key: -1}})
        assert text == f"zero_optimization.offload_param.{key}: must be >= 0 (got -1)"
    text = problems({"stage": 3, "offload_param": {"pin_memory": "yes"}})
    assert text == 'zero_optimization.offload_param.pin_memory: expected true or false, got "yes"'


def test_deprecated_cpu_offload_param() -> None:
    zc = load({"stage": 3, "cpu_offload_param": True}).zero_optimization
    assert zc.offload_params
    assert zc.model_dump(mode="json")["cpu_offload_param"] is None  # one spelling in to_dict()
    assert not load({"stage": 3, "cpu_offload_param": False}).zero_optimization.offload_params
    text = problems({"stage": 2, "cpu_offload_param": True})
    assert (
        text.startswith("zero_optimization.cpu_offload_param: ") and "stage 3 (stage is 2)" in text
    )
    text = problems({"stage": 3, "cpu_offload_param": True, "offload_param": {"device": "cpu"}})
    assert text.startswith("zero_optimization.cpu_offload_param: deprecated alias of offload_param")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_optimizer_cpu_at_stages_1_2_3(stage: int) -> None:
    assert load({"stage": stage, "offload_optimizer": {"device": "cpu"}}).zero_optimization.offload


def test_offload_optimizer_cpu_at_stage0_names_the_stages() -> None:
    text = problems({"stage": 0, "offload_optimizer": {"device": "cpu"}})
    assert text.startswith(
        'zero_optimization.offload_optimizer.device: "cpu" needs zero_optimization.stage 1, 2 or 3'
    )


def test_stage3_config_round_trips() -> None:
    cfg = load(
        {
            "stage": 3,
            "cpu_offload": True,
            "offload_param": {"device": "cpu"},
            "prefetch_bucket_size": 1e7,
            "stage3_gather_fp16_weights_on_model_save": True,
        },
        world_size=2,
    )
    as_dict = cfg.to_dict()
    assert json.loads(json.dumps(as_dict)) == as_dict
    again = load_config(as_dict, 2)
    assert again.to_dict() == as_dict
    zc = again.zero_optimization
    assert zc.offload and zc.offload_params and zc.stage3_prefetch_bucket_size == 10_000_000
    assert zc.stage3_gather_16bit_weights_on_model_save is True


def test_stage3_example_config_file() -> None:
    cfg = load_config(CONFIGS / "gpt2_stage3_offload.json", 8)
    zc = cfg.zero_optimization
    assert zc.stage == 3 and zc.offload and zc.offload_params and zc.overlap_comm
    assert cfg.dtype in (torch.float16, torch.bfloat16)
    assert cfg.train_batch_size == 8 * cfg.train_micro_batch_size_per_gpu


# ---- "auto" sizes from the model's hidden size ---------------------------------------------------


def tiny_model(hidden_size: object = None, hidden_sizes: object = None) -> torch.nn.Module:
    model = torch.nn.Linear(4, 4)
    fields = {}
    if hidden_size is not None:
        fields["hidden_size"] = hidden_size
    if hidden_sizes is not None:
        fields["hidden_sizes"] = hidden_sizes
    model.config = SimpleNamespace(**fields)  # type: ignore[assignment]
    return model


AUTO_ZERO = {
    "stage": 3,
    "reduce_bucket_size": "auto",
    "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto",
}


def test_auto_keys_are_recorded() -> None:
    cfg = load(AUTO_ZERO)
    assert cfg.auto_keys == frozenset(
        {
            "zero_optimization.reduce_bucket_size",
            "zero_optimization.stage3_prefetch_bucket_size",
            "zero_optimization.stage3_param_persistence_threshold",
        }
    )
    assert load({"stage": 3}).auto_keys == frozenset()


def test_auto_sizes_from_hidden_size(caplog: pytest.LogCaptureFixture) -> None:
    cfg = load(AUTO_ZERO)
    zc = cfg.zero_optimization
    assert zc.reduce_bucket_size == 500_000_000  # the default until resolved
    with caplog.at_level(logging.INFO, logger="zero_offload"):
        resolved, chosen = resolve_auto_sizes(cfg, tiny_model(hidden_size=768))
    assert chosen == {
        "reduce_bucket_size": 768 * 768,
        "stage3_prefetch_bucket_size": int(0.9 * 768 * 768),
        "stage3_param_persistence_threshold": 7680,
    }
    rz = resolved.zero_optimization
    assert (
        rz.reduce_bucket_size,
        rz.stage3_prefetch_bucket_size,
        rz.stage3_param_persistence_threshold,
    ) == (589_824, 530_841, 7680)
    # A new config: the loaded one keeps its settings, and what load_config recorded carries over.
    assert zc.reduce_bucket_size == 500_000_000 and resolved is not cfg
    assert resolved.auto_keys == cfg.auto_keys and resolved.world_size == cfg.world_size
    lines = [r for r in caplog.records if r.name == "zero_offload"]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    text = lines[0].getMessage()
    for key, value in chosen.items():
        assert f"zero_optimization.{key}={value}" in text
    assert resolved.to_dict()["zero_optimization"]["reduce_bucket_size"] == 589_824


def test_auto_sizes_only_for_keys_that_were_auto() -> None:
    cfg = load({"stage": 3, "reduce_bucket_size": 1000, "prefetch_bucket_size": "auto"})
    resolved, chosen = resolve_auto_sizes(cfg, tiny_model(hidden_size=100))
    assert chosen == {"stage3_prefetch_bucket_size": 9000}  # the alias spelling counts too
    zc = resolved.zero_optimization
    assert zc.reduce_bucket_size == 1000 and zc.stage3_param_persistence_threshold == 100_000


def test_auto_sizes_hidden_sizes_uses_the_largest() -> None:
    cfg = load(AUTO_ZERO)
    _, chosen = resolve_auto_sizes(cfg, tiny_model(hidden_sizes=[64, 512, 256]))
    assert chosen["reduce_bucket_size"] == 512 * 512
    assert chosen["stage3_param_persistence_threshold"] == 5120


def test_auto_stage3_sizes_not_filled_below_stage3() -> None:
    cfg = load({**AUTO_ZERO, "stage": 2})
    resolved, chosen = resolve_auto_sizes(cfg, tiny_model(hidden_size=64))
    assert chosen == {"reduce_bucket_size": 4096}
    assert resolved.zero_optimization.stage3_prefetch_bucket_size == 50_000_000


@pytest.mark.parametrize(
    "model",
    [
        torch.nn.Linear(2, 2),  # no .config at all
        tiny_model(hidden_size=True),
        tiny_model(hidden_size=0),
        tiny_model(hidden_size="768"),
        tiny_model(hidden_sizes=[]),
    ],
)
def test_auto_sizes_without_hidden_size_keep_defaults(model: torch.nn.Module) -> None:
    cfg = load(AUTO_ZERO)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resolve_auto_sizes(cfg, model) == (cfg, {})
    assert len(caught) == 1
    message = str(caught[0].message)
    for key, default in (
        ("reduce_bucket_size", 500_000_000),
        ("stage3_prefetch_bucket_size", 50_000_000),
        ("stage3_param_persistence_threshold", 100_000),
    ):
        assert f"zero_optimization.{key}={default}" in message
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000


def test_no_auto_keys_nothing_to_do() -> None:
    cfg = load({"stage": 3})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_auto_sizes(cfg, torch.nn.Linear(2, 2)) == (cfg, {})


def test_auto_sizes_from_the_projects_gpt2() -> None:
    from zero_offload.models.gpt2 import GPT2Config, GPT2Model

    model = GPT2Model(GPT2Config(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=8))
    cfg = load_config(CONFIGS / "gpt2_stage3_offload.json", 1)
    _, chosen = resolve_auto_sizes(cfg, model)
    assert chosen == {
        "reduce_bucket_size": 1024,
        "stage3_prefetch_bucket_size": 921,
        "stage3_param_persistence_threshold": 320,
    }


# ---- memory formula and estimate -----------------------------------------------------------------

N_PARAMS = 1_500_000_000  # the seeds' 1.5B model


def stage3_bytes(offload: bool, offload_param: bool, **kw) -> dict[str, int]:
    from zero_offload.runtime.plan.memory import expected_bytes

    dtype = kw.pop("dtype", torch.float16)
    return expected_bytes(8000, dtype, 3, 8, offload, offload_param=offload_param, **kw)


def test_stage3_categories() -> None:
    s = 1000  # shard: 8000 padded elements on 8 ranks, 2 bytes each in fp16
    assert stage3_bytes(False, False) == {
        "device.param_shard": 2 * s,
        "device.grad_shard": 2 * s,
        "device.master_shard": 4 * s,
        "device.optimizer_state": 8 * s,
    }
    assert stage3_bytes(True, False) == {
        "device.param_shard": 2 * s,
        "host.master_shard": 4 * s,
        "host.optimizer_state": 8 * s,
        "host.grad_shard": 2 * s,
        "host.param_staging": 2 * s,
    }
    assert stage3_bytes(False, True) == {
        "host.param_shard": 2 * s,
        "device.grad_shard": 2 * s,
        "device.master_shard": 4 * s,
        "device.optimizer_state": 8 * s,
    }
    # Both offloads: the host update writes the 16-bit param shard in place, no staging.
    assert stage3_bytes(True, True) == {
        "host.param_shard": 2 * s,
        "host.master_shard": 4 * s,
        "host.optimizer_state": 8 * s,
        "host.grad_shard": 2 * s,
    }


def test_stage3_accumulation_delayed_and_fp32() -> None:
    s = 1000
    acc = stage3_bytes(True, True, gas=2, delayed=True)
    assert acc["device.grad_shard"] == 2 * s and acc["host.grad_shard"] == 4 * s
    fp32 = stage3_bytes(True, False, dtype=torch.float32)
    assert "host.param_staging" not in fp32 and fp32["device.param_shard"] == 4 * s
    bf16 = stage3_bytes(False, True, dtype=torch.bfloat16)
    assert bf16["host.param_shard"] == 2 * s


def test_offload_param_needs_stage3_in_the_formula() -> None:
    from zero_offload.runtime.plan.memory import expected_bytes

    with pytest.raises(ValueError, match="offload_param needs stage 3"):
        expected_bytes(8000, torch.float16, 2, 8, True, offload_param=True)


# (offload, offload_param) -> (device bytes/param, host bytes/param) on N ranks, fp16: DESIGN.md's
# rows (stage 3: (2+2+12)/N on the device; both offloads: (2+4+4+4+2)/N on the host, none on it).
STAGE3_PER_PARAM = {
    (False, False): (16, 0),
    (True, False): (2, 16),
    (False, True): (14, 2),
    (True, True): (0, 16),
}


@pytest.mark.parametrize("world", [1, 8])
def test_stage3_rows_for_1p5b(world: int) -> None:
    from zero_offload.runtime.plan.memory import per_param_table

    rows = {
        (r["offload"], r["offload_param"]): r
        for r in per_param_table(N_PARAMS, world, torch.float16)
        if r["stage"] == 3
    }
    assert rows.keys() == STAGE3_PER_PARAM.keys()
    for case, (device, host) in STAGE3_PER_PARAM.items():
        assert rows[case]["device"] == device * N_PARAMS // world, case
        assert rows[case]["host"] == host * N_PARAMS // world, case
        assert rows[case]["optimizer_state"] == 12 * N_PARAMS // world, case
    # Below stage 3 the rows are unchanged and offload_param is never set.
    others = [r for r in per_param_table(N_PARAMS, world) if r["stage"] < 3]
    assert len(others) == 5 and not any(r["offload_param"] for r in others)


@pytest.mark.parametrize(
    ("world", "expected"),
    [
        (
            1,
            [
                ["none", "24.00", "0.00", "18.00", "none"],
                ["cpu", "3.00", "24.00", "18.00", "none"],
                ["none", "21.00", "3.00", "18.00", "cpu"],
                ["cpu", "0.00", "24.00", "18.00", "cpu"],
            ],
        ),
        (
            8,
            [
                ["none", "3.00", "0.00", "2.25", "none"],
                ["cpu", "0.38", "3.00", "2.25", "none"],
                ["none", "2.62", "0.38", "2.25", "cpu"],
                ["cpu", "0.00", "3.00", "2.25", "cpu"],
            ],
        ),
    ],
)
def test_estimate_prints_stage3_rows(world: int, expected: list[list[str]], capsys) -> None:
    from zero_offload.cli.main import main

    assert main(["estimate", "--params", "1.5e9", "--gpus", str(world), "--stage", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[-1] == "offload_param"
    rows = [line.split() for line in lines[2:] if line.split()[0] == "3"]
    assert [row[1:] for row in rows] == expected
    assert "stage3_max_live_parameters" in lines[-1]  # live gathered params are outside the formula
