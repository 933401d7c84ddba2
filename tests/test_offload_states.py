"""DeepSpeed's ``engine.offload_states()`` / ``engine.reload_states()`` (RLHF trainers free the
training engine's device memory while a generation engine runs).

The definition of correct: train, offload, reload, train on = the same run never offloaded, bit
for bit (params, fp32 master, losses), at stages 1-3 on one and two ranks, offloading between
steps and in the middle of an accumulation window (the accumulated gradients survive). While
offloaded, the device bytes of the named states are gone (their storages hold nothing) and the
memory report shows them on the host; a call that needs an offloaded state raises instead of
computing on missing values; what is already on the host (``offload_optimizer``) is a no-op."""

from __future__ import annotations

import copy

import pytest
import torch
from distributed import run_ranks
from parity import assert_partitioned_if_asked, batches, engine_config, global_step, make_model

STEPS, GAS, MICRO = 4, 2, 2


def _cfg(stage: int, dtype: str = "bf16", offload: bool = False, **extra) -> dict:
    zero = {"stage3_param_persistence_threshold": 0} if stage == 3 else None
    return engine_config(
        stage, offload, GAS, MICRO, 0.5, True, dtype, 100, zero_extra=zero, **extra
    )


def _storages(engine) -> list[torch.Tensor]:
    """The engine's model-state tensors that live on the device (measured, not reported)."""
    out = []
    for og in engine.opt_groups:
        out += [og.flat.flat, og.grads.flat_grad, og.grads.accum, og.grads.device_shard]
        st = og.optimizer.state
        parts = [st.device] if hasattr(st, "cut") else [st] if st.where == "device" else []
        for part in parts:
            out.append(getattr(part, "master", None))
            for t in (part.exp_avg, part.exp_avg_sq):  # an 8-bit moment: codes and scales
                out += [t.codes, t.scales] if hasattr(t, "codes") else [t]
    if engine.param_store is not None:
        out += [s for s in engine.param_store.shards if s is not None and s.device == engine.device]
    return [t for t in out if t is not None]


def _device_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes the storages of ``tensors`` hold now (each storage once)."""
    seen = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
    return sum(seen.values())


def _refused(call) -> str | None:
    """The EngineUsageError message of ``call()``, None if it ran."""
    from zero_offload.runtime.engine.guards import EngineUsageError

    try:
        call()
    except EngineUsageError as e:
        return str(e)
    return None


def _module_loss(engine, x, y) -> float:
    import zero_offload

    with torch.no_grad(), zero_offload.zero.GatheredParameters(engine.module.parameters()):
        return float(engine.module(x[:MICRO], y[:MICRO]))


def _offload_cycle(engine, include, x, y) -> dict:
    """Offload ``include``, record what changed and which calls are refused, reload."""
    from zero_offload.utils import safe_get_full_fp32_param

    tensors = _storages(engine)  # (stage 3 points the shard list at host copies meanwhile)
    before, dev_before = engine.memory_report(), _device_bytes(tensors)
    loss_before = _module_loss(engine, x, y)
    engine.offload_states(include=include)
    params = [p for p in engine.module.parameters() if p.numel() or hasattr(p, "ds_tensor")]
    after, dev_after = engine.memory_report(), _device_bytes(tensors)
    engine.offload_states(include=include)  # again: nothing more to move
    facts = {
        # (stage 3 also releases every gathered param: those entries are not storages moved)
        "moved": {
            k: before.get(k, 0) - after.get(k, 0)
            for k in before
            if not k.startswith("peak") and not k.endswith(("gathered_params", "persistent_params"))
        },
        "host_gain": sum(after.get(k, 0) - before.get(k, 0) for k in after if k.startswith("host")),
        "device_freed": dev_before - dev_after,
        "twice_same": engine.memory_report() == after,
        "states": {s.value for s in engine.offloaded_states()},
        "forward": _refused(lambda: engine(x[:MICRO], y[:MICRO])),
        "fragment": _refused(lambda: safe_get_full_fp32_param(params[0])),
        # the module itself reads the host copies (pointed at them as DeepSpeed does)
        "module_loss_same": _module_loss(engine, x, y) == loss_before,
        "no_empty_views": all(
            (p.ds_tensor if hasattr(p, "ds_tensor") else p).untyped_storage().nbytes() > 0
            or (p.ds_tensor if hasattr(p, "ds_tensor") else p).numel() == 0
            for p in params
        ),
        "grads_away": all(p.grad is None for p in params),
    }
    engine.reload_states()
    engine.reload_states()  # nothing offloaded: a no-op
    held = lambda r: {k: v for k, v in r.items() if not k.startswith("peak.")}  # noqa: E731
    facts["reloaded"] = held(engine.memory_report()) == held(before)
    facts["reloaded"] &= _device_bytes(_storages(engine)) == dev_before
    return facts


def _train(cfg: dict, include=None, offload: bool = True) -> dict:
    """STEPS steps of GAS micro-steps; with ``offload``: an offload cycle after step 2 (between
    windows) and one after the first micro-step of step 3 (mid-window)."""
    import zero_offload
    from zero_offload.core import dist
    from zero_offload.utils import safe_get_full_fp32_param

    world, rank = dist.world_size(), dist.rank()
    model = make_model()
    engine, *_ = zero_offload.initialize(model=model, config=copy.deepcopy(cfg))
    assert_partitioned_if_asked(model, cfg)
    losses, cycles = [], []
    for i, (x, y) in enumerate(batches(STEPS, world, GAS, MICRO)):
        if i == 2 and offload:
            cycles.append(_offload_cycle(engine, include, x, y))
        for k in range(GAS):
            lo = (k * world + rank) * MICRO
            loss = engine(x[lo : lo + MICRO], y[lo : lo + MICRO])
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
            if i == 2 and k == 0 and offload:
                cycles.append(_offload_cycle(engine, include, x, y))
    named = dict(model.named_parameters())
    master = {n: safe_get_full_fp32_param(p).clone() for n, p in named.items() if p.requires_grad}
    with zero_offload.zero.GatheredParameters(model.parameters()):
        module = {n: p.detach().clone() for n, p in named.items()}
    return {"losses": losses, "master": master, "module": module, "cycles": cycles}


def _same_run(a: dict, b: dict) -> bool:
    return (
        a["losses"] == b["losses"]
        and all(torch.equal(a["master"][n], b["master"][n]) for n in b["master"])
        and all(torch.equal(a["module"][n], b["module"][n]) for n in b["module"])
    )


def _both(cfg: dict, include=None) -> tuple[dict, dict]:
    return _train(cfg, include), _train(cfg, offload=False)


def _check_moved_all(cycle: dict) -> None:
    """Everything offloaded: no model-state byte left on the device, all of it on the host."""
    assert cycle["device_freed"] > 0 and cycle["twice_same"] and cycle["reloaded"]
    device_drop = sum(v for k, v in cycle["moved"].items() if k.startswith("device."))
    assert device_drop == cycle["device_freed"] == cycle["host_gain"]
    assert "lp_params" in cycle["forward"] and "reload_states" in cycle["forward"]
    assert "reload_states" in cycle["fragment"]
    assert cycle["module_loss_same"] and cycle["no_empty_views"] and cycle["grads_away"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_reload_is_bitwise_one_rank(stage):
    got, ref = _both(_cfg(stage))
    assert _same_run(got, ref)
    for cycle in got["cycles"]:
        _check_moved_all(cycle)
        assert {"optim_states", "hp_params", "lp_params", "lp_grads"} <= cycle["states"]


def _two_ranks() -> dict:
    out = {}
    for stage in (1, 2, 3):
        got, ref = _both(_cfg(stage))
        out[stage] = {"same": _same_run(got, ref), "cycles": got["cycles"]}
    return out


def test_offload_reload_is_bitwise_two_ranks():
    for stage, r in run_ranks(2, _two_ranks).items():
        assert r["same"], f"stage {stage}"
        for cycle in r["cycles"]:
            _check_moved_all(cycle)


def test_fp32_master_that_is_the_params_moves_them_too():
    """fp32 with the optimizer on the device: the master is the params' own storage, so
    offloading hp_params empties the params as well, and forward says so."""
    got, ref = _both(_cfg(2, "fp32"), include=["hp_params"])
    assert _same_run(got, ref)
    cycle = got["cycles"][0]
    assert cycle["states"] == {"hp_params", "lp_params"}
    assert cycle["moved"]["device.params"] > 0 and "device.master_shard" not in cycle["moved"]
    assert "lp_params" in cycle["forward"]


@pytest.mark.parametrize("stage", [2, 3])
def test_states_already_on_the_host_are_a_no_op(stage):
    from zero_offload.runtime.update.buffers import OffloadStateType as S

    got, ref = _both(_cfg(stage, offload=True), include=[S.optim_states, S.hp_params])
    assert _same_run(got, ref)
    for cycle in got["cycles"]:
        assert cycle["states"] == set() and cycle["device_freed"] == 0
        assert all(v == 0 for v in cycle["moved"].values())
        assert cycle["forward"] is None  # nothing it needs was moved
    got, ref = _both(_cfg(stage, offload=True))  # the rest (params, grads) still moves
    assert _same_run(got, ref)
    for cycle in got["cycles"]:
        _check_moved_all(cycle)
        assert "optim_states" not in cycle["states"] and "lp_params" in cycle["states"]


def test_partial_offload_moves_the_device_part():
    # ratio 0: the tiny shard is below one 2048-element unit, so a twin keeps it all on the device
    got, ref = _both(_cfg(3, offload=True, ratio=0.0))
    assert _same_run(got, ref)
    for cycle in got["cycles"]:
        _check_moved_all(cycle)
        assert cycle["moved"]["device.optimizer_state"] > 0


def test_optimizer_states_offloaded_forward_and_backward_still_run():
    """Only the optimizer state offloaded (a trainer computing log-probs with the training
    engine): forward and backward run, the step is refused until reload, then goes on exactly."""
    import zero_offload

    def run(offload: bool) -> dict:
        model = make_model()
        engine, *_ = zero_offload.initialize(model=model, config=_cfg(3))
        (x, y), (x2, y2) = batches(2, 1, GAS, MICRO)
        global_step(engine, x, y)
        refused = None
        if offload:
            engine.offload_states(include=["optim_states"])
        for k in range(GAS):
            loss = engine(x2[k * MICRO : (k + 1) * MICRO], y2[k * MICRO : (k + 1) * MICRO])
            engine.backward(loss)
            if offload and k == GAS - 1:
                refused = _refused(engine.step)
                engine.reload_states()
            engine.step()
        with zero_offload.zero.GatheredParameters(model.parameters()):
            params = [p.detach().clone() for p in model.parameters()]
        return {"refused": refused, "params": params}

    got, ref = run(True), run(False)
    assert "optim_states" in got["refused"] and "step" in got["refused"]
    assert all(torch.equal(a, b) for a, b in zip(got["params"], ref["params"]))


def test_refusals_name_the_argument():
    import zero_offload
    from zero_offload.config.zero.zero_optimization import OffloadDeviceEnum
    from zero_offload.runtime.engine.guards import EngineUsageError

    engine, *_ = zero_offload.initialize(model=make_model(), config=_cfg(2))
    with pytest.raises(ValueError, match="NVMe offload is not supported"):
        engine.offload_states(device=OffloadDeviceEnum.nvme)
    with pytest.raises(ValueError, match=r"device=.*allowed none, cpu, nvme; got 'gpu'"):
        engine.offload_states(device="gpu")
    with pytest.raises(ValueError, match=r"include=.*unknown state 'params'.*lp_params"):
        engine.offload_states(include=["params"])
    engine.offload_states(device="none")  # DeepSpeed: a warning, nothing moved
    assert engine.offloaded_states() == set()
    engine.offload_states(include="lp_grads")  # one state, not a list
    assert {s.value for s in engine.offloaded_states()} == {"lp_grads"}
    with pytest.raises(EngineUsageError, match="zero_grad.*lp_grads"):
        engine.zero_grad()
    engine.reload_states()

    stage0, *_ = zero_offload.initialize(model=make_model(), config=_cfg(0))
    with pytest.raises(EngineUsageError, match="stage 1, 2 or 3"):
        stage0.offload_states()
    frozen = make_model().requires_grad_(False)
    no_opt, *_ = zero_offload.initialize(model=frozen, config=_cfg(2))
    with pytest.raises(AssertionError, match="without an optimizer"):
        no_opt.offload_states()


def test_offload_param_is_refused_as_deepspeed_does():
    import zero_offload

    cfg = _cfg(3)
    cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    engine, *_ = zero_offload.initialize(model=make_model(), config=cfg)
    with pytest.raises(AssertionError, match="not supported for offloaded parameters"):
        engine.offload_states()


def test_delayed_update_pending_while_offloaded():
    """A host update still pending (delayed update) lands after reload exactly as without the
    offload; eval() (which applies it, writing the params) is refused meanwhile; destroy()
    reloads first."""
    import zero_offload
    from zero_offload.runtime.engine.guards import EngineUsageError

    cfg = _cfg(2, offload=True, delayed_update=True, delayed_update_after=1)
    got, ref = _both(cfg)
    assert _same_run(got, ref)
    for cycle in got["cycles"]:
        _check_moved_all(cycle)
    engine, *_ = zero_offload.initialize(model=make_model(), config=copy.deepcopy(cfg))
    for x, y in batches(2, 1, GAS, MICRO):
        global_step(engine, x, y)
    engine.offload_states()
    with pytest.raises(EngineUsageError, match="flush_delayed_update.*lp_params"):
        engine.eval()
    engine.destroy()
    assert engine.offloaded_states() == set()


def test_stage3_edit_while_params_offloaded_lands_after_reload():
    """Stage 3: a GatheredParameters edit while only the 16-bit params are away writes their
    host copy (and the device master), and reload carries it back; with the master away the
    edit is refused before anything is written."""
    import zero_offload
    from zero_offload.runtime.engine.guards import EngineUsageError
    from zero_offload.utils import safe_get_full_fp32_param

    model = make_model()
    engine, *_ = zero_offload.initialize(model=model, config=_cfg(3))
    global_step(engine, *batches(1, 1, GAS, MICRO)[0])
    engine.offload_states(include=["lp_params"])
    with zero_offload.zero.GatheredParameters([model.l1.weight], modifier_rank=0):
        model.l1.weight.data.fill_(0.25)
    engine.reload_states()
    with zero_offload.zero.GatheredParameters([model.l1.weight]):
        assert torch.all(model.l1.weight == 0.25)
    assert torch.all(safe_get_full_fp32_param(model.l1.weight) == 0.25)
    engine.offload_states(include=["hp_params"])
    with pytest.raises(EngineUsageError, match="modifier_rank.*hp_params"):
        with zero_offload.zero.GatheredParameters([model.l1.weight], modifier_rank=0):
            pass
    engine.reload_states()
