"""DeepSpeed's public ZeRO config names in the namespace (``deepspeed.runtime.zero.config``,
``offload_config``, ``leaf_module_config``), ``deepspeed.utils.set_log_level_from_string``, the
``deepspeed.ops.aio`` probe and ``deepspeed.runtime.torch_autocast``'s queries: DeepSpeed's
documented defaults, aliases and errors, backed by this project's config models."""

from __future__ import annotations

import logging

import pytest
import torch

from zero_offload.config import ConfigError, NotImplementedSettingWarning
from zero_offload.deepspeed_compat.ops.aio import AsyncIOBuilder
from zero_offload.deepspeed_compat.runtime import torch_autocast
from zero_offload.deepspeed_compat.runtime.zero import config as zc
from zero_offload.deepspeed_compat.runtime.zero import leaf_module_config as lmc
from zero_offload.deepspeed_compat.utils import logging as ds_logging


def test_zero_config_defaults_follow_deepspeed() -> None:
    config = zc.DeepSpeedZeroConfig()
    assert config.stage == zc.ZeroStageEnum.disabled
    assert config.offload_param is None and config.offload_optimizer is None
    assert config.overlap_comm is False
    assert zc.DeepSpeedZeroConfig(stage=3).overlap_comm is True
    assert config.prefetch_bucket_size == 50_000_000
    assert config.param_persistence_threshold == 100_000
    assert config.pipeline_loading_checkpoint is False
    assert config.leaf_module.classes == lmc.DEFAULT_LEAF_MODULE_CLASSES
    assert config.leaf_module.names == lmc.DEFAULT_LEAF_MODULE_NAMES == []
    assert config.leaf_module.name_suffixes == lmc.DEFAULT_LEAF_MODULE_NAME_SUFFIXES == []


@pytest.mark.parametrize(
    ("key", "field"),
    [
        ("stage3_prefetch_bucket_size", "prefetch_bucket_size"),
        ("stage3_param_persistence_threshold", "param_persistence_threshold"),
        ("stage3_max_live_parameters", "max_live_parameters"),
        ("stage3_max_reuse_distance", "max_reuse_distance"),
        ("prefetch_bucket_size", "prefetch_bucket_size"),
    ],
)
def test_stage3_aliases_read_under_deepspeeds_field_name(key: str, field: str) -> None:
    assert getattr(zc.DeepSpeedZeroConfig(stage=3, **{key: 12345}), field) == 12345


def test_deprecated_and_sixteen_bit_save_spellings() -> None:
    for key in ("stage3_gather_fp16_weights_on_model_save", "gather_16bit_weights_on_model_save"):
        assert zc.DeepSpeedZeroConfig(stage=3, **{key: True}).gather_16bit_weights_on_model_save
    config = zc.DeepSpeedZeroConfig(stage=3, cpu_offload_param=True, cpu_offload=True)
    assert isinstance(config.offload_param, zc.DeepSpeedZeroOffloadParamConfig)
    assert isinstance(config.offload_optimizer, zc.DeepSpeedZeroOffloadOptimizerConfig)
    assert config.offload_param.device == zc.OffloadDeviceEnum.cpu


def test_empty_offload_sections_are_sections() -> None:
    config = zc.DeepSpeedZeroConfig(stage=3, offload_param={}, offload_optimizer={})
    assert isinstance(config.offload_param, zc.DeepSpeedZeroOffloadParamConfig)
    assert config.offload_optimizer.device == "none"


@pytest.mark.parametrize(("read", "write"), [(False, False), (True, False), (False, True)])
def test_offload_optimizer_pipeline_is_read_or_write(read: bool, write: bool) -> None:
    oc = zc.DeepSpeedZeroOffloadOptimizerConfig(pipeline_read=read, pipeline_write=write)
    assert oc.pipeline is (read or write)


def test_leaf_module_strings_are_lists() -> None:
    payload = {"classes": "my.Class", "names": "sub", "name_suffixes": ["tail", "tail"]}
    leaf = zc.DeepSpeedZeroConfig(leaf_module=payload).leaf_module
    assert (leaf.classes, leaf.names, leaf.name_suffixes) == (["my.Class"], ["sub"], ["tail"])


def test_unbuilt_key_is_accepted_with_a_warning_and_read_back() -> None:
    with pytest.warns(NotImplementedSettingWarning, match="zero_hpz_partition_size"):
        config = zc.DeepSpeedZeroConfig(stage=3, zero_hpz_partition_size=2)
    assert config.zero_hpz_partition_size == 2
    with pytest.raises(AttributeError):
        _ = config.no_such_field


@pytest.mark.parametrize(
    ("data", "named"),
    [
        ({"stage": 4}, "zero_optimization.stage"),
        ({"stagee": 1}, '"zero_optimization.stagee"'),
        ({"reduce_bucket_size": -1}, "zero_optimization.reduce_bucket_size"),
        ({"stage": 3, "stage3_prefetch_bucket_size": "x"}, "stage3_prefetch_bucket_size"),
    ],
)
def test_bad_input_is_a_value_error_naming_the_key(data: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named) as info:
        zc.DeepSpeedZeroConfig(**data)
    assert isinstance(info.value, ConfigError)


def test_stage_enum_and_offload_device_enum() -> None:
    assert [s.value for s in zc.ZeroStageEnum] == [0, 1, 2, 3]
    assert zc.ZeroStageEnum.max_stage == 3 and zc.ZeroStageEnum.weights == 3
    assert zc.DeepSpeedZeroConfig(stage=zc.ZeroStageEnum.gradients).stage == 2
    device = zc.OffloadDeviceEnum.nvme
    assert device == "nvme" and zc.OffloadDeviceEnum("cpu") is zc.OffloadDeviceEnum.cpu


def test_set_log_level_from_string(caplog: pytest.LogCaptureFixture) -> None:
    own = logging.getLogger("test_ds_zero_config_names")
    handler = logging.StreamHandler()
    own.addHandler(handler)
    try:
        ds_logging.set_log_level_from_string("ERROR", custom_logger=own)
        assert own.level == handler.level == logging.ERROR
    finally:
        own.removeHandler(handler)
    before = ds_logging.logger.level
    try:
        ds_logging.set_log_level_from_string("debug")
        assert ds_logging.logger.level == logging.DEBUG
    finally:
        ds_logging.logger.setLevel(before)
    with pytest.raises(ValueError, match="verbose.*debug, info, warning, error, critical"):
        ds_logging.set_log_level_from_string("verbose")


def test_aio_probe_answers_compatible_and_refuses_the_raw_handle() -> None:
    assert AsyncIOBuilder().is_compatible()
    with pytest.raises(AttributeError, match="AsyncIOBuilder"):
        AsyncIOBuilder().load()


def test_comm_dtype_queries() -> None:
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float32))
    assert not torch_autocast.has_comm_dtype(p)
    assert torch_autocast.get_comm_dtype(p) == torch.float32
    setattr(p, torch_autocast.PARAM_COMM_DTYPE_ATTR_NAME, torch.bfloat16)
    assert torch_autocast.has_comm_dtype(p)
    assert torch_autocast.get_all_comm_dtypes([p]) == {torch.bfloat16}
    assert "torch.nn.modules.linear.Linear" in (
        torch_autocast.get_default_autocast_lower_precision_modules()
    )


def test_names_import_through_the_deepspeed_opt_in() -> None:
    import os
    import subprocess
    import sys
    import textwrap

    code = """
        import zero_offload
        zero_offload.as_deepspeed()
        from deepspeed.ops.aio import AsyncIOBuilder
        from deepspeed.runtime.torch_autocast import get_comm_dtype
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig, ZeroStageEnum
        from deepspeed.runtime.zero.leaf_module_config import DEFAULT_LEAF_MODULE_CLASSES
        from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
        from deepspeed.utils import set_log_level_from_string
        print(DeepSpeedZeroConfig(stage=ZeroStageEnum.weights).overlap_comm, OffloadDeviceEnum.cpu.value)
    """
    env = {k: v for k, v in os.environ.items() if k != "ZERO_OFFLOAD_AS_DEEPSPEED"}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "cpu"]
