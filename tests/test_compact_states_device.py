"""Compact optimizer states where the state is beside the params (``paths/device_update.py``,
``core/state/alias_state.py``).

The device placement (no optimizer offload): DeepSpeed's bf16 master + bf16 moments, and 8-bit
moments, at stages 1-3. The bf16 master is the bf16 params themselves (no master of its own);
the update is the host kernel's arithmetic in PyTorch over the whole shard range, chunk by
chunk. Checked bitwise against a written reference over the engine's flat layout (the 8-bit
blocks are the flat shard's) and against the host update of the same format running the same
reference arithmetic (1 and 2 ranks); the memory report and ``expected_memory``; bitwise resume;
``offload_states``.

Stage 3 with both offloads "cpu": the host param shard is the bf16 master (no
``host.master_shard``), bitwise the run with a master of its own, and resumes bitwise. Partial
offload (ratio 0.5): two compact parts, bitwise the whole offload, one checkpoint for both."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from distributed import every_rank
from parity import LR, WD, batches, engine_config, global_step, make_model

from zero_offload.kernels.adam_states import as_cpu_adam_hyper, reference_adam_step_states
from zero_offload.kernels.quant_maps import QuantizedMoment, zeros_moment

STEPS, MICRO = 5, 4
BF16 = {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}


def _config(stage: int, states: str, offload: bool = False, offload_param: bool = False) -> dict:
    zero = {"stage3_param_persistence_threshold": 0} if stage == 3 else None
    cfg = engine_config(stage, offload, 1, MICRO, 0.0, False, "bf16",
                        offload_param=offload_param, zero_extra=zero)  # fmt: skip
    if states == "bf16":
        cfg["bf16"].update(BF16)
    elif states in ("8bit", "8bit-fp32-master"):
        cfg["optimizer"]["type"] = "AdamW8bit"
        cfg["bf16"]["bf16_master_weights_and_grads"] = states == "8bit"
    elif states == "bf16-sr":
        cfg["bf16"].update(BF16, stochastic_rounding=True)
    return cfg


def _engine(cfg: dict):
    import zero_offload

    model = make_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = zero_offload.initialize(model=model, config=copy.deepcopy(cfg))
    return engine, model


def _train(engine, steps: int = STEPS, seed: int = 1, world: int = 1, rank: int = 0):
    return [
        global_step(engine, x, y, world, rank) for x, y in batches(steps, world, 1, MICRO, seed)
    ]


def _params(model) -> dict[str, torch.Tensor]:
    from zero_offload.utils import safe_get_full_fp32_param

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return {n: safe_get_full_fp32_param(p).clone() for n, p in named}


def _zeros(n: int, states: str, signed: bool):
    if states == "8bit":
        return zeros_moment(n, signed)
    return torch.zeros(n, dtype=torch.bfloat16)


def _flat_reference(engine, states: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch, bf16 params; one rank's flat buffer of the engine's layout (its padding
    zero) as the bf16 master, updated by the written reference with moments in ``states``:
    the 8-bit blocks are the engine's, block for block."""
    (og,) = engine.opt_groups
    layout = og.flat.layout
    assert all(s.flat_start == s.shard_start for s in og.flat.segments(True))  # one rank
    model = make_model().to(torch.bfloat16)
    named = dict(model.named_parameters())
    params = [named[n] for n in og.flat.names]
    offsets = list(zip(layout.offsets, layout.numels))
    master = torch.zeros(layout.total, dtype=torch.bfloat16)
    for p, (o, n) in zip(params, offsets):
        master[o : o + n] = p.detach().reshape(-1)
    m, v = _zeros(layout.total, states, True), _zeros(layout.total, states, False)
    # DeepSpeed's fp32 hyperparameters, as the engine's compact updates take them
    hyper = as_cpu_adam_hyper(dict(lr=LR, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=WD))
    losses = []
    for step, (x, y) in enumerate(batches(STEPS, 1, 1, MICRO), 1):
        model.zero_grad()
        loss = model(x, y)
        loss.backward()
        grad = torch.zeros(layout.total, dtype=torch.bfloat16)
        for p, (o, n) in zip(params, offsets):
            if p.grad is not None:
                grad[o : o + n] = p.grad.reshape(-1)
        reference_adam_step_states(master, m, v, grad, step=step, adamw=True, **hyper)
        with torch.no_grad():
            for p, (o, n) in zip(params, offsets):
                p.copy_(master[o : o + n].view_as(p))
        losses.append(float(loss.detach()))
    return losses, {n: named[n].detach().float() for n in og.flat.names}


@pytest.mark.parametrize("states", ["bf16", "8bit"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_device_states_match_the_written_reference(one_rank, stage, states):
    engine, model = _engine(_config(stage, states))
    so = engine.opt_groups[0].optimizer
    assert so.placement.optimizer == "device" and so.aliased  # the bf16 params are the master
    m = so.state.exp_avg
    assert isinstance(m, QuantizedMoment) if states == "8bit" else m.dtype == torch.bfloat16
    losses = _train(engine)
    ref_losses, ref = _flat_reference(engine, states)
    got = _params(model)  # one rank, one micro-batch per step: the same gradients, bitwise
    assert all(torch.equal(got[n], r) for n, r in ref.items())
    assert losses == ref_losses


def _device_and_host(stage: int, states: str, world: int = 1, rank: int = 0) -> list[dict]:
    out = []
    for offload in (False, True):
        engine, model = _engine(_config(stage, states, offload))
        out.append({"losses": _train(engine, world=world, rank=rank), "params": _params(model),
                    "aliased": [og.optimizer.aliased for og in engine.opt_groups],
                    "tensor": [og.state.master is not None for og in engine.opt_groups]})  # fmt: skip
    return out


@pytest.mark.parametrize("states", ["bf16", "8bit", "bf16-sr", "8bit-fp32-master"])
def test_device_update_is_the_host_update(one_rank, monkeypatch, states):
    """The device update computes what the host update computes with the reference arithmetic
    (bitwise): same chunks, blocks, rounding and stochastic-rounding draws."""
    monkeypatch.setenv("ZERO_OFFLOAD_KERNEL", "reference")
    device, host = _device_and_host(2, states)
    assert all(device["aliased"]) == (states != "8bit-fp32-master")
    assert not any(host["aliased"])
    assert device["losses"] == host["losses"]
    assert all(torch.equal(device["params"][n], host["params"][n]) for n in host["params"])


def _world2_device_and_host() -> list[dict]:
    import os

    from zero_offload.core import dist

    os.environ["ZERO_OFFLOAD_KERNEL"] = "reference"
    # stage 2 with several buckets: a rank's partition is one slice per bucket (the aliased
    # master has no single tensor: chunks are read and written back through the flat buffer)
    return _device_and_host(2, "8bit", dist.world_size(), dist.rank())


def test_device_update_is_the_host_update_world2():
    for device, host in every_rank(2, _world2_device_and_host):
        assert all(device["aliased"]) and not any(device["tensor"])
        assert device["losses"] == host["losses"]
        assert all(torch.equal(device["params"][n], host["params"][n]) for n in host["params"])


@pytest.mark.parametrize(
    "states,per_param", [("bf16", 4.0), ("8bit", 2 + 8 / 256), ("8bit-fp32-master", 6 + 8 / 256)]
)
def test_device_memory_report(one_rank, states, per_param):
    """Optimizer-side device bytes per shard element: bf16 moments 4, 8-bit moments with their
    scales 2.03 (the bf16 master is the params), plus 4 for an fp32 master of its own."""
    engine, _ = _engine(_config(2, states))
    report, expected = engine.memory_report(), engine.expected_memory()
    numel = sum(og.optimizer.state.numel for og in engine.opt_groups)
    state = report["device.optimizer_state"] + report.get("device.master_shard", 0)
    assert state / numel == pytest.approx(per_param, abs=0.01)
    assert ("device.master_shard" in report) == (states == "8bit-fp32-master")
    assert "device.master_shard" not in expected or states == "8bit-fp32-master"
    for key in ("device.master_shard", "device.optimizer_state", "device.params"):
        assert report.get(key, 0) == pytest.approx(expected.get(key, 0), rel=0.02), key


def _resume(tmp_path, cfg: dict) -> None:
    engine, model = _engine(cfg)
    _train(engine, steps=3)
    engine.save_checkpoint(str(tmp_path), tag="t")
    after = _train(engine, steps=3, seed=7)
    want = _params(model)
    engine2, model2 = _engine(cfg)
    engine2.load_checkpoint(str(tmp_path), tag="t")
    assert _train(engine2, steps=3, seed=7) == after
    got = _params(model2)
    assert all(torch.equal(got[n], want[n]) for n in want)


@pytest.mark.parametrize("states", ["bf16", "8bit"])
@pytest.mark.parametrize("stage", [1, 3])
def test_device_resume_is_bitwise(one_rank, tmp_path, stage, states):
    _resume(tmp_path, _config(stage, states))


@pytest.mark.parametrize("states", ["bf16", "8bit"])
def test_offload_states_moves_compact_moments(one_rank, states):
    """``offload_states`` moves the compact moments (8-bit: codes and scales) and the params
    that are the master, and a reload gives the run back bitwise."""
    from test_offload_states import _cfg, _check_moved_all, _same_run
    from test_offload_states import _train as _train_with_cycles

    cfg = _cfg(2)
    cfg["bf16"].update(BF16)
    if states == "8bit":
        cfg["bf16"]["bf16_optimizer_states"] = False
        cfg["optimizer"]["type"] = "AdamW8bit"
    got, ref = _train_with_cycles(cfg), _train_with_cycles(cfg, offload=False)
    assert _same_run(got, ref)
    for cycle in got["cycles"]:
        _check_moved_all(cycle)
        assert cycle["moved"]["device.optimizer_state"] > 0
        assert "device.master_shard" not in cycle["moved"]


# ---- stage 3 with both offloads "cpu": the host param shard is the bf16 master ---------------


def _host_alias_run(states: str) -> dict:
    engine, model = _engine(_config(3, states, offload=True, offload_param=True))
    losses = _train(engine)
    return {
        "aliased": [og.optimizer.aliased for og in engine.opt_groups],
        "staging": [og.optimizer.staging.kind for og in engine.opt_groups],
        "report": {k: v for k, v in engine.memory_report().items() if not k.startswith("peak.")},
        "expected": engine.expected_memory(),
        "losses": losses,
        "params": _params(model),
    }


@pytest.mark.parametrize("states", ["bf16", "8bit", "bf16-sr"])
def test_host_param_shard_is_the_bf16_master(one_rank, monkeypatch, states):
    from zero_offload.runtime.engine import assembly

    aliased = _host_alias_run(states)
    assert all(aliased["aliased"]) and aliased["staging"] == ["none"]  # nothing copied
    assert "host.master_shard" not in aliased["report"]
    have = {k: v for k, v in aliased["report"].items() if "frozen" not in k}
    assert have == aliased["expected"]
    monkeypatch.setattr(assembly, "alias_state", lambda *a, **k: None)
    own = _host_alias_run(states)
    assert not any(own["aliased"]) and own["report"]["host.master_shard"] > 0
    assert aliased["losses"] == own["losses"]
    assert all(torch.equal(aliased["params"][n], own["params"][n]) for n in own["params"])


@pytest.mark.parametrize("states", ["bf16", "8bit"])
def test_host_alias_resume_is_bitwise(one_rank, tmp_path, states):
    _resume(tmp_path, _config(3, states, offload=True, offload_param=True))


# ---- partial offload (ratio < 1): a device part and a host part, one format ---------------------


def _twin_config(ratio: float, states: str) -> dict:
    from test_twin_flow import _config as twin_config

    cfg = twin_config(ratio)
    cfg["bf16"] = {"enabled": True, **BF16}
    if states == "8bit":
        cfg["bf16"]["bf16_optimizer_states"] = False
        cfg["optimizer"]["type"] = "AdamW8bit"
    return cfg


def _twin_run(cfg: dict, steps: int, load: str | None = None, save: str | None = None) -> dict:
    from test_twin_flow import _batches, _model

    import zero_offload

    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = zero_offload.initialize(model=model, config=copy.deepcopy(cfg))
    if load is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the same format: no conversion warning
            engine.load_checkpoint(load, tag="t")
    batches_ = _batches(1)
    losses = []
    for x, y in batches_[:steps] if load is None else batches_[-steps:]:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        if save is not None and len(losses) == 1:
            engine.save_checkpoint(save, tag="t")
    (og,) = engine.opt_groups
    return {
        "losses": losses,
        "params": _params(model),
        "cut": getattr(og.state, "cut", None),
        "numel": og.state.numel,
        "report": {k: v for k, v in engine.memory_report().items() if not k.startswith("peak.")},
        "expected": engine.expected_memory(),
    }


@pytest.mark.parametrize("states", ["bf16", "8bit"])
def test_partial_offload_is_the_host_update(one_rank, monkeypatch, tmp_path, states):
    """ratio 0.5: the device part runs the device update, the host part the host kernel, each
    over whole 8-bit blocks; with the reference arithmetic on both sides the run is bitwise the
    whole-offload run (ratio 1.0). The memory report counts each part in the format, as
    ``expected_memory`` does; a twin's checkpoint (its codes and scales joined at the cut)
    resumes bitwise into a twin and into a whole-offload run."""
    monkeypatch.setenv("ZERO_OFFLOAD_KERNEL", "reference")
    twin = _twin_run(_twin_config(0.5, states), 3, save=str(tmp_path))
    whole = _twin_run(_twin_config(1.0, states), 3)
    assert 0 < twin["cut"] < twin["numel"] and whole["cut"] is None
    assert twin["losses"] == whole["losses"]
    assert all(torch.equal(twin["params"][n], whole["params"][n]) for n in whole["params"])
    for key in ("device.master_shard", "device.optimizer_state", "host.optimizer_state"):
        assert twin["report"][key] == twin["expected"][key], key
    per = 2 + (4 if states == "bf16" else 2 + 8 / 256)  # bf16 master + both moments
    assert twin["report"]["device.optimizer_state"] + twin["report"]["device.master_shard"] == (
        pytest.approx(twin["cut"] * per)
    )
    for ratio in (0.5, 1.0):  # the saved step 1, then steps 2 and 3 again
        again = _twin_run(_twin_config(ratio, states), 2, load=str(tmp_path))
        assert again["losses"] == twin["losses"][1:]
        assert all(torch.equal(again["params"][n], twin["params"][n]) for n in twin["params"])
