"""The compact optimizer states' config: DeepSpeed 0.19.8's ``bf16.bf16_master_weights_and_grads``
and ``bf16.bf16_optimizer_states`` (accepted as DeepSpeed accepts them, refused by key as it
refuses them), this project's ``bf16.stochastic_rounding`` and ``Adam8bit``/``AdamW8bit``
types, and ``StateFormat.from_config``, the format the update path builds from them."""

from __future__ import annotations

import warnings

import pytest
import torch

import zero_offload
from zero_offload.config import ConfigError, load_config
from zero_offload.config.errors import NotImplementedSettingWarning
from zero_offload.core.state.format import StateFormat

OFFLOAD = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
MASTER = {"enabled": True, "bf16_master_weights_and_grads": True}
STATES = {**MASTER, "bf16_optimizer_states": True}


def _load(zero=None, bf16=None, optimizer=None, **top):
    cfg = {"train_batch_size": 2, **top}
    cfg["zero_optimization"] = OFFLOAD if zero is None else zero
    if bf16 is not None:
        cfg["bf16"] = bf16
    if optimizer is not None:
        cfg["optimizer"] = optimizer
    with warnings.catch_warnings():
        warnings.simplefilter("error", NotImplementedSettingWarning)  # built: never "not built"
        return load_config(cfg)


def _refused(match: str, **kw) -> str:
    with pytest.raises(ConfigError, match=match) as info:
        _load(**kw)
    return str(info.value)


# -- accepted, as DeepSpeed accepts them -------------------------------------------------------


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_master_and_states_load_at_stages_1_to_3(stage):
    for zero in ({**OFFLOAD, "stage": stage}, {"stage": stage}):  # states: offload or not
        cfg = _load(zero=zero, bf16=STATES, optimizer={"type": "Adam"})
        assert cfg.bf16.bf16_master_weights_and_grads and cfg.bf16.bf16_optimizer_states
        fmt = StateFormat.from_config(cfg)
        assert (fmt.master, fmt.moments) == (torch.bfloat16, "bf16")
        assert fmt.bytes_per_element() == 6.0


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_bf16_master_with_fp32_moments_loads_with_offload(device, tmp_path):
    off = {"device": device, "nvme_path": str(tmp_path)} if device == "nvme" else {"device": device}
    cfg = _load(zero={"stage": 3, "offload_optimizer": off}, bf16=MASTER)
    fmt = StateFormat.from_config(cfg)
    assert (fmt.master, fmt.moments, fmt.bytes_per_element()) == (torch.bfloat16, "fp32", 10.0)


def test_the_keys_are_no_longer_warned_as_not_built():
    # _load turns the not-built warning into an error: loading at all is the check
    _load(bf16={**STATES, "stochastic_rounding": True})
    _load(bf16={"enabled": True, "bf16_master_weights_and_grads": False})


@pytest.mark.parametrize(
    ("kind", "params", "adamw"),
    [
        ("Adam8bit", {}, True),  # DeepSpeed's Adam: adam_w_mode true by default
        ("adam8bit", {"adam_w_mode": False}, False),  # matched case-insensitively
        ("AdamW8bit", {"adam_w_mode": False}, True),
    ],
)
def test_8bit_types_are_adam_with_a_block(kind, params, adamw):
    cfg = _load(zero={"stage": 0}, optimizer={"type": kind, "params": {"lr": 0.01, **params}})
    assert cfg.optimizer.eight_bit and cfg.optimizer.adamw is adamw
    assert cfg.optimizer.params.lr == 0.01 and cfg.optimizer.params.block_size == 256
    fmt = StateFormat.from_config(cfg)
    assert (fmt.master, fmt.moments, fmt.block) == (torch.float32, "8bit", 256)


def test_from_config_reads_every_field():
    assert StateFormat.from_config(_load()) == StateFormat()  # no keys: today's fp32 state
    cfg = _load(
        zero={"stage": 2},
        bf16={**MASTER, "stochastic_rounding": True},
        optimizer={"type": "AdamW8bit", "params": {"block_size": 64}},
        seed=7,
    )
    assert StateFormat.from_config(cfg) == StateFormat(
        master=torch.bfloat16, moments="8bit", block=64, stochastic_round=True, seed=7
    )
    # the 6-byte mode: bf16 master 2 + two 8-bit moments with their scales
    assert StateFormat.from_config(cfg).bytes_per_element() == 2 + 2 * (1 + 4 / 64)


@pytest.mark.parametrize("block", [32, 64, 128, 256])
def test_block_size_powers_of_two_32_to_256(block):
    cfg = _load(optimizer={"type": "Adam8bit", "params": {"block_size": block}})
    assert StateFormat.from_config(cfg).block == block


# -- refused, each by its key --------------------------------------------------------------------


@pytest.mark.parametrize("block", [16, 48, 512, 0, True, "64", 64.5])
def test_block_size_refused(block):
    _refused(
        r"optimizer\.params\.block_size",
        optimizer={"type": "Adam8bit", "params": {"block_size": block}},
    )


def test_block_size_is_not_an_adam_param():
    text = _refused(
        r'"optimizer\.params\.block_size"',
        optimizer={"type": "AdamW", "params": {"block_size": 64}},
    )
    assert "Adam8bit" in text


def test_states_need_the_master():
    text = _refused(
        r"bf16\.bf16_optimizer_states: true requires bf16\.bf16_master_weights_and_grads",
        bf16={"enabled": True, "bf16_optimizer_states": True},
    )
    assert "DeepSpeed" in text


@pytest.mark.parametrize("bf16", [MASTER, STATES])
def test_stage_0_refused(bf16):
    _refused(
        r"bf16\.bf16_master_weights_and_grads: true is only supported with ZeRO Stage 1, 2, or 3",
        zero={"stage": 0},
        bf16=bf16,
    )


def test_master_needs_bf16_enabled():
    _refused(
        r"bf16\.bf16_master_weights_and_grads: .*requires bf16\.enabled true$",
        bf16={"enabled": False, "bf16_master_weights_and_grads": True},
    )
    text = _refused(
        r"bf16\.bf16_master_weights_and_grads: .*requires bf16\.enabled true",
        bf16={"bf16_master_weights_and_grads": True},
        fp16={"enabled": True},
    )
    assert "fp16.enabled" in text


def test_master_with_fp32_moments_needs_offload():
    text = _refused(
        r"bf16\.bf16_master_weights_and_grads: true without bf16\.bf16_optimizer_states",
        zero={"stage": 2},
        bf16=MASTER,
    )
    assert "zero_optimization.offload_optimizer.device" in text
    # ... which 8-bit moments are not: they stay on the device
    fmt = StateFormat.from_config(
        _load(zero={"stage": 2}, bf16=MASTER, optimizer={"type": "Adam8bit"})
    )
    assert (fmt.master, fmt.moments) == (torch.bfloat16, "8bit")


def test_torch_adam_with_master_and_offload_refused():
    _refused(
        r"optimizer\.params\.torch_adam: true with bf16\.bf16_master_weights_and_grads",
        bf16=STATES,
        optimizer={"type": "Adam", "params": {"torch_adam": True}},
    )
    _load(
        zero={"stage": 2}, bf16=STATES, optimizer={"type": "Adam", "params": {"torch_adam": True}}
    )


def test_stochastic_rounding_needs_the_master():
    _refused(
        r"bf16\.stochastic_rounding: true .*requires bf16\.bf16_master_weights_and_grads",
        bf16={"enabled": True, "stochastic_rounding": True},
    )


def test_8bit_with_bf16_states_refused():
    text = _refused(
        r"bf16\.bf16_optimizer_states: true keeps bf16 moments and optimizer\.type \"AdamW8bit\"",
        bf16=STATES,
        optimizer={"type": "AdamW8bit"},
    )
    assert "pick one" in text


def test_muon_with_master_refused():
    _refused(
        r'optimizer\.type: "Muon" with bf16\.bf16_master_weights_and_grads',
        bf16=STATES,
        optimizer={"type": "Muon"},
    )


@pytest.mark.parametrize(
    ("bf16", "optimizer", "names"),
    [
        (STATES, {"type": "AdamW"}, "bf16.bf16_master_weights_and_grads"),
        (MASTER, {"type": "AdamW"}, "bf16.bf16_master_weights_and_grads"),
        ({"enabled": True}, {"type": "Adam8bit"}, 'optimizer.type "Adam8bit"'),
    ],
)
def test_zenflow_with_compact_states_refused(bf16, optimizer, names):
    text = _refused(
        r"zero_optimization\.zenflow: keeps fp32 states",
        zero={**OFFLOAD, "zenflow": {"topk_ratio": 0.1}},
        bf16=bf16,
        optimizer=optimizer,
    )
    assert names in text


def test_top_level_spelling_points_to_the_bf16_block():
    for key in ("bf16_optimizer_states", "bf16_master_weights_and_grads"):
        text = _refused(rf'unknown key "{key}": a key of the "bf16" block', **{key: True})
        assert f'"bf16": {{"enabled": true, "{key}": true}}' in text


@pytest.mark.parametrize(
    ("bf16", "kind", "names"),
    [
        (STATES, "AdamW", "bf16.bf16_master_weights_and_grads, bf16.bf16_optimizer_states"),
        ({"enabled": True}, "AdamW8bit", 'optimizer.type "AdamW8bit"'),
    ],
)
def test_client_optimizer_with_compact_states_refused(one_rank, bf16, kind, names):
    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    client = torch.optim.AdamW(model.parameters())
    cfg = {"train_batch_size": 1, "bf16": bf16, "zero_optimization": {"stage": 2},
           "optimizer": {"type": kind}}  # fmt: skip
    with pytest.raises(ConfigError, match="with a client optimizer \\(AdamW\\)") as info:
        zero_offload.initialize(model=model, optimizer=client, config=cfg)
    assert str(info.value).startswith(names)
