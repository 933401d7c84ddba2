"""NVMe offload config (DeepSpeed's ZeRO-Infinity keys): ``device: "nvme"`` with ``nvme_path``, the
rules between the offload blocks and the stage, the top-level ``aio`` section, the ZeroConfig
properties the engine reads, and the ``nvme_path`` preflight check."""

from __future__ import annotations

import copy
import os
import shutil
import warnings
from collections import namedtuple
from pathlib import Path

import pytest

from zero_offload.config import (
    AioConfig,
    ConfigError,
    NotImplementedSettingWarning,
    SettingSpellingWarning,
    ZeroOffloadConfig,
    load_config,
)
from zero_offload.nvme.preflight import check_nvme_path

OPT_PATH = "zero_optimization.offload_optimizer.nvme_path"
PARAM_PATH = "zero_optimization.offload_param.nvme_path"

# DeepSpeed's ZeRO-Infinity example (docs/_pages/config-json.md and the ZeRO-Infinity tutorial).
ZERO_INFINITY = {
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {
            "device": "nvme",
            "nvme_path": "/local_nvme",
            "pin_memory": True,
            "buffer_count": 4,
            "fast_init": False,
        },
        "offload_param": {
            "device": "nvme",
            "nvme_path": "/local_nvme",
            "pin_memory": True,
            "buffer_count": 5,
            "buffer_size": 1e8,
            "max_in_cpu": 1e9,
        },
    },
    "aio": {
        "block_size": 262144,
        "queue_depth": 32,
        "thread_count": 1,
        "single_submit": False,
        "overlap_events": True,
    },
}


def quiet_load(source: dict, world_size: int = 1) -> ZeroOffloadConfig:
    """load_config asserting it emits no warning at all."""
    source = {"train_batch_size": world_size, **source}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(source, world_size)
    assert [str(w.message) for w in caught] == []
    return cfg


def problems(config: dict) -> str:
    with pytest.raises(ConfigError) as info:
        load_config({"train_batch_size": 1, **config})
    assert len(info.value.problems) == 1, info.value.problems
    return info.value.problems[0]


def zero(**blocks) -> dict:
    return {"zero_optimization": blocks}


def nvme_optimizer(**extra) -> dict:
    return {"device": "nvme", "nvme_path": "/local_nvme", **extra}


# ---- valid configs ---------------------------------------------------------------------------


def test_zero_infinity_example_loads() -> None:
    cfg = quiet_load(ZERO_INFINITY)
    zc = cfg.zero_optimization
    assert (zc.offload_device, zc.offload, zc.optimizer_nvme_path) == ("nvme", True, "/local_nvme")
    assert (zc.offload_param_device, zc.offload_params, zc.param_nvme_path) == (
        "nvme",
        True,
        "/local_nvme",
    )
    assert zc.uses_nvme
    oc, pc = zc.offload_optimizer, zc.offload_param
    assert oc is not None and pc is not None
    assert (oc.pin_memory, oc.buffer_count, oc.fast_init) == (True, 4, False)
    assert (pc.buffer_count, pc.buffer_size, pc.max_in_cpu) == (5, 100_000_000, 1_000_000_000)
    aio = cfg.aio
    assert (aio.block_size, aio.queue_depth, aio.threads) == (262144, 32, 1)
    assert (aio.single_submit, aio.overlap_events, aio.use_gds) == (False, True, False)


def test_deepspeed_optimizer_nvme_keys_load() -> None:
    # DeepSpeed's offload_optimizer keys, every one, at a non-default value.
    cfg = quiet_load(
        zero(
            stage=2,
            offload_optimizer=nvme_optimizer(
                buffer_count=2,
                pin_memory=False,
                pipeline_read=True,
                pipeline_write=True,
                fast_init=True,
            ),
        )
    )
    oc = cfg.zero_optimization.offload_optimizer
    assert oc is not None and oc.buffer_count == 2 and not oc.pin_memory
    assert (oc.pipeline_read, oc.pipeline_write, oc.fast_init) == (True, True, True)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_optimizer_nvme_at_stages_1_2_3(stage: int) -> None:
    zc = quiet_load(zero(stage=stage, offload_optimizer=nvme_optimizer())).zero_optimization
    assert (zc.offload_device, zc.offload, zc.optimizer_nvme_path) == ("nvme", True, "/local_nvme")
    assert (zc.offload_param_device, zc.offload_params, zc.param_nvme_path) == ("none", False, None)


def test_nvme_optimizer_with_cpu_params_and_the_reverse() -> None:
    zc = quiet_load(
        zero(stage=3, offload_optimizer=nvme_optimizer(), offload_param={"device": "cpu"})
    ).zero_optimization
    assert (zc.offload_device, zc.offload_param_device, zc.param_nvme_path) == ("nvme", "cpu", None)
    zc = quiet_load(
        zero(
            stage=3,
            offload_optimizer={"device": "cpu"},
            offload_param={"device": "nvme", "nvme_path": "/p"},
        )
    ).zero_optimization
    assert (zc.offload_device, zc.optimizer_nvme_path) == ("cpu", None)
    assert (zc.offload_param_device, zc.param_nvme_path, zc.offload_params) == ("nvme", "/p", True)
    assert zc.offload and zc.uses_nvme


def test_cpu_and_none_properties() -> None:
    zc = quiet_load(zero(stage=3, offload_optimizer={"device": "cpu"})).zero_optimization
    assert (zc.offload_device, zc.offload, zc.optimizer_nvme_path, zc.uses_nvme) == (
        "cpu",
        True,
        None,
        False,
    )
    zc = quiet_load(zero(stage=3)).zero_optimization
    assert (zc.offload_device, zc.offload, zc.offload_param_device, zc.offload_params) == (
        "none",
        False,
        "none",
        False,
    )
    assert (zc.optimizer_nvme_path, zc.param_nvme_path) == (None, None)


def test_nvme_path_of_a_cpu_offload_is_not_an_nvme_path() -> None:
    with pytest.warns(NotImplementedSettingWarning, match=OPT_PATH):
        cfg = load_config(
            {
                "train_batch_size": 1,
                **zero(stage=2, offload_optimizer={"device": "cpu", "nvme_path": "/x"}),
            }
        )
    assert cfg.zero_optimization.optimizer_nvme_path is None


def test_numeric_strings_as_deepspeed_reads_them() -> None:
    # The offload blocks are DeepSpeed pydantic models: "4" is 4 there.
    cfg = quiet_load(zero(stage=2, offload_optimizer=nvme_optimizer(buffer_count="4")))
    assert cfg.zero_optimization.offload_optimizer.buffer_count == 4


# ---- rules of the offload blocks -------------------------------------------------------------


@pytest.mark.parametrize("block", ["offload_optimizer", "offload_param"])
@pytest.mark.parametrize("path", [None, "", "  "])
def test_nvme_needs_nvme_path(block: str, path: str | None) -> None:
    section = {"device": "nvme"} if path is None else {"device": "nvme", "nvme_path": path}
    text = problems(zero(stage=3, **{block: section}))
    assert text.startswith(f'zero_optimization.{block}.nvme_path: required with device "nvme"')
    assert "must be a local directory" in text


def test_nvme_path_must_be_a_string() -> None:
    text = problems(zero(stage=3, offload_param={"device": "nvme", "nvme_path": 5}))
    assert text == f"{PARAM_PATH}: expected a string, got 5"


@pytest.mark.parametrize("block", ["offload_optimizer", "offload_param"])
def test_bad_device_lists_deepspeeds_values(block: str) -> None:
    text = problems(zero(stage=3, **{block: {"device": "disk"}}))
    assert text == (f'zero_optimization.{block}.device: allowed: "none", "cpu", "nvme"; got "disk"')
    text = problems(zero(stage=3, **{block: {"device": True}}))
    assert text.endswith('allowed: "none", "cpu", "nvme"; got true')


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_param_nvme_needs_stage3(stage: int) -> None:
    text = problems(zero(stage=stage, offload_param={"device": "nvme", "nvme_path": "/p"}))
    assert text.startswith('zero_optimization.offload_param.device: "nvme" parameter offload ')
    assert f"needs zero_optimization.stage 3 (stage is {stage})" in text


def test_optimizer_nvme_needs_stage_1_2_or_3() -> None:
    text = problems(zero(stage=0, offload_optimizer=nvme_optimizer()))
    assert text.startswith(
        'zero_optimization.offload_optimizer.device: "nvme" needs zero_optimization.stage 1, 2 '
        "or 3 (stage is 0)"
    )


@pytest.mark.parametrize("count", [0, 1])
def test_optimizer_nvme_buffer_count_at_least_2(count: int) -> None:
    text = problems(zero(stage=2, offload_optimizer=nvme_optimizer(buffer_count=count)))
    assert text.startswith(
        "zero_optimization.offload_optimizer.buffer_count: must be >= 2 with device "
        f'"nvme" (got {count})'
    )
    assert "chunk k+1" in text


def test_buffer_count_below_2_is_fine_without_nvme() -> None:
    oc = quiet_load(
        zero(stage=2, offload_optimizer={"device": "cpu", "buffer_count": 1})
    ).zero_optimization.offload_optimizer
    assert oc is not None and oc.buffer_count == 1


def test_delayed_update_is_not_supported_with_nvme() -> None:
    text = problems(zero(stage=2, offload_optimizer=nvme_optimizer(delayed_update=True)))
    assert text == (
        'zero_optimization.offload_optimizer.delayed_update: needs offload_optimizer.device "cpu"; '
        '"nvme" is not supported with it'
    )


@pytest.mark.parametrize(
    "block, key, value, expected",
    [
        ("offload_optimizer", "pipeline_read", 1, "expected true or false, got 1"),
        ("offload_optimizer", "pipeline_write", "no", 'expected true or false, got "no"'),
        ("offload_optimizer", "fast_init", None, "expected true or false, got null"),
        ("offload_optimizer", "pin_memory", 0, "expected true or false, got 0"),
        ("offload_param", "pin_memory", "yes", 'expected true or false, got "yes"'),
        ("offload_param", "buffer_size", -1, "must be >= 0 (got -1)"),
        ("offload_param", "max_in_cpu", 1.5, "expected an integer, got 1.5"),
        ("offload_param", "buffer_count", -1, "must be >= 0 (got -1)"),
    ],
)
def test_nvme_tuning_keys_stay_validated(block: str, key: str, value, expected: str) -> None:
    section = {"device": "nvme", "nvme_path": "/local_nvme", key: value}
    assert problems(zero(stage=3, **{block: section})) == (
        f"zero_optimization.{block}.{key}: {expected}"
    )


# ---- aio -------------------------------------------------------------------------------------


def test_aio_defaults_are_deepspeeds() -> None:
    aio = quiet_load({}).aio
    assert (aio.block_size, aio.queue_depth, aio.intra_op_parallelism, aio.threads) == (
        1048576,
        8,
        1,
        1,
    )
    assert (aio.single_submit, aio.overlap_events, aio.use_gds, aio.thread_count) == (
        False,
        True,
        False,
        None,
    )
    assert AioConfig().threads == 1


def test_aio_deepspeed_format_loads() -> None:
    # DeepSpeed's AIO_FORMAT, as printed in deepspeed/runtime/swap_tensor/constants.py.
    aio = {
        "block_size": 1048576,
        "queue_depth": 8,
        "intra_op_parallelism": 1,
        "single_submit": False,
        "overlap_events": True,
        "use_gds": False,
    }
    cfg = quiet_load({**zero(stage=3, offload_optimizer=nvme_optimizer()), "aio": aio})
    assert cfg.to_dict()["aio"] == {**aio, "thread_count": None}


def test_aio_null_is_deepspeeds_defaults() -> None:
    assert quiet_load({"aio": None}).aio == AioConfig()


def test_aio_is_no_longer_an_ignored_key() -> None:
    cfg = quiet_load({"aio": {"block_size": 4096, "thread_count": 3}})  # nothing on NVMe
    assert "aio" not in cfg.ignored_keys and cfg.aio.threads == 3


def test_aio_without_nvme_is_valid_and_silent() -> None:
    cfg = quiet_load(
        {
            **zero(stage=2, offload_optimizer={"device": "cpu"}),
            "aio": {"queue_depth": 64, "thread_count": 2, "intra_op_parallelism": 4},
        }
    )
    assert cfg.aio.threads == 4 and not cfg.zero_optimization.uses_nvme


def test_thread_count_alone_is_used() -> None:
    cfg = quiet_load({**ZERO_INFINITY, "aio": {"thread_count": 6}})
    assert (cfg.aio.threads, cfg.aio.intra_op_parallelism, cfg.aio.thread_count) == (6, 6, None)


def test_intra_op_parallelism_alone_is_used() -> None:
    assert quiet_load({**ZERO_INFINITY, "aio": {"intra_op_parallelism": 3}}).aio.threads == 3


def test_both_spellings_equal_is_silent() -> None:
    aio = {"thread_count": 4, "intra_op_parallelism": 4}
    assert quiet_load({**ZERO_INFINITY, "aio": aio}).aio.threads == 4


def test_both_spellings_differ_intra_op_parallelism_wins_with_a_warning() -> None:
    source = {"train_batch_size": 1, **ZERO_INFINITY, "aio": {"thread_count": 8}}
    source["aio"]["intra_op_parallelism"] = 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(source)
    assert cfg.aio.threads == 2
    assert [w.category for w in caught] == [SettingSpellingWarning]
    message = str(caught[0].message)
    assert "aio.thread_count=8" in message and "aio.intra_op_parallelism=2" in message
    assert "aio.intra_op_parallelism=2 is used" in message


@pytest.mark.parametrize(
    "aio",
    [
        {"thread_count": 5},
        {"intra_op_parallelism": 5},
        {"thread_count": 5, "intra_op_parallelism": 5},
        {"thread_count": 7, "intra_op_parallelism": 5},
    ],
)
def test_to_dict_round_trips_with_both_spellings(aio: dict) -> None:
    source = {"train_batch_size": 2, **copy.deepcopy(ZERO_INFINITY), "aio": aio}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SettingSpellingWarning)
        cfg = load_config(source, 2)
    as_dict = cfg.to_dict()
    assert as_dict["aio"]["intra_op_parallelism"] == 5 and as_dict["aio"]["thread_count"] is None
    again = quiet_load(as_dict, 2)  # one spelling: no warning
    assert again.to_dict() == as_dict and again.aio.threads == 5
    assert again.zero_optimization.optimizer_nvme_path == "/local_nvme"


def test_to_dict_of_the_zero_infinity_example_round_trips() -> None:
    as_dict = quiet_load(ZERO_INFINITY).to_dict()
    assert quiet_load(as_dict).to_dict() == as_dict


def test_use_gds_is_not_built() -> None:
    text = problems({**ZERO_INFINITY, "aio": {"use_gds": True}})
    assert text.startswith("aio.use_gds: GPUDirect Storage is not built; use false")
    assert "host memory" in text


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("block_size", 0, "must be > 0 (got 0)"),
        ("block_size", "1048576", 'expected an integer, got "1048576"'),  # read as given
        ("queue_depth", -1, "must be > 0 (got -1)"),
        ("intra_op_parallelism", 0, "must be >= 1 (got 0)"),
        ("thread_count", 0, "must be >= 1 (got 0)"),
        ("thread_count", True, "expected an integer, got true"),
        ("single_submit", 1, "expected true or false, got 1"),
        ("overlap_events", "true", 'expected true or false, got "true"'),
    ],
)
def test_aio_values_name_the_key(key: str, value, expected: str) -> None:
    text = problems({"aio": {key: value}})
    assert text.startswith(f"aio.{key}: {expected}"), text


def test_aio_unknown_key_is_named() -> None:
    text = problems({"aio": {"queue_dept": 8}})
    assert text == 'unknown key "aio.queue_dept"; did you mean "queue_depth"?'


# ---- preflight -------------------------------------------------------------------------------


def test_preflight_returns_the_resolved_path(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "swap").mkdir()
    got = check_nvme_path(OPT_PATH, "swap", 0)
    assert got == (tmp_path / "swap").resolve() and got.is_absolute()
    assert os.listdir(got) == []  # the probe file is gone
    assert check_nvme_path(OPT_PATH, tmp_path, 1) == tmp_path.resolve()  # a PathLike


def test_preflight_creates_a_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "deeper"  # created with its parents, as DeepSpeed does
    assert check_nvme_path(OPT_PATH, missing, 0) == missing.resolve()
    assert missing.is_dir() and os.listdir(missing) == []


def test_preflight_a_path_that_cannot_be_created(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    missing = tmp_path / "file" / "swap"  # a parent that is a file: mkdir fails
    with pytest.raises(ConfigError) as info:
        check_nvme_path(OPT_PATH, missing, 0)
    text = str(info.value)
    assert text.startswith(f'{OPT_PATH}: "{missing}" does not exist and could not be created')
    assert "nvme_path must be a writable local directory" in text


def test_preflight_a_file_is_not_a_directory(tmp_path: Path) -> None:
    file = tmp_path / "file"
    file.write_text("x")
    with pytest.raises(ConfigError, match="is not a directory") as info:
        check_nvme_path(PARAM_PATH, file, 0)
    assert str(info.value).startswith(f'{PARAM_PATH}: "{file}"')


def test_preflight_empty_path() -> None:
    with pytest.raises(ConfigError, match=f"^{OPT_PATH}: empty path"):
        check_nvme_path(OPT_PATH, "", 0)


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root can write a read-only directory"
)
def test_preflight_read_only_directory(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(ConfigError) as info:
            check_nvme_path(OPT_PATH, ro, 0)
    finally:
        ro.chmod(0o700)
    assert str(info.value).startswith(f'{OPT_PATH}: "{ro}" is not writable')


def test_preflight_not_writable_as_any_user(tmp_path: Path, monkeypatch) -> None:
    # The same failure as root would see it on a read-only mount.
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("tempfile.mkstemp", refuse)
    with pytest.raises(ConfigError) as info:
        check_nvme_path(OPT_PATH, tmp_path, 0)
    text = str(info.value)
    assert text.startswith(f'{OPT_PATH}: "{tmp_path}" is not writable')
    assert "Permission denied" in text


def test_preflight_not_enough_space(tmp_path: Path, monkeypatch) -> None:
    usage = namedtuple("usage", "total used free")
    gib = 1 << 30
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(100 * gib, 99 * gib, gib))
    with pytest.raises(ConfigError) as info:
        check_nvme_path(PARAM_PATH, tmp_path, 3 * gib)
    text = str(info.value)
    assert text.startswith(f'{PARAM_PATH}: "{tmp_path}" has 1.00 GiB free, 3.00 GiB needed')
    assert str(3 * gib) in text
    assert check_nvme_path(PARAM_PATH, tmp_path, gib) == tmp_path.resolve()  # exactly enough


def test_preflight_rejects_a_bad_need() -> None:
    with pytest.raises(ValueError, match="need_bytes"):
        check_nvme_path(OPT_PATH, "/", -1)
