"""Issue: ``engine.offload_states()`` after any ``save_checkpoint``/``load_checkpoint`` raised
"Trying to resize storage that is not resizable" (the save's ``numpy()`` views had fixed the
engine's storages) and never worked again in that process; with Muon on the device (stages 1
and 2) it raised ``AttributeError`` half way, leaving the engine half offloaded. Now both round
trip bit for bit, and a storage that truly cannot move is refused by name before anything moves."""

from __future__ import annotations

import pytest
import reliability_helpers as h
import torch

import zero_offload
from zero_offload.runtime.engine.guards import EngineUsageError


def _step(eng, seed: int = 1) -> None:
    eng.backward(eng(h.batch(seed).to(eng.dtype)))
    eng.step()


def _params(eng) -> list[torch.Tensor]:
    with eng.params_on_host():
        return [p.detach().clone() for p in eng.module.parameters()]


def _assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("after", ["save", "load"])
def test_offload_states_after_a_checkpoint_round_trips(stage, after, tmp_path):
    extra = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    cfg = {} if stage < 3 else extra
    if after == "load":  # saved by another engine: the load alone must leave offload working
        saver = h.engine(stage, False, "fp32", **cfg)
        _step(saver)
        saver.save_checkpoint(str(tmp_path / "saved"))
    runs = []
    for offload in (False, True):
        eng = h.engine(stage, False, "fp32", **cfg)
        if after == "load":
            eng.load_checkpoint(str(tmp_path / "saved"))
        else:
            _step(eng)
            eng.save_checkpoint(str(tmp_path / f"ck{offload}"))
        if offload:
            eng.offload_states()
            assert eng.offloaded_states()
            eng.reload_states()
        _step(eng, 2)
        runs.append(_params(eng))
    _assert_same(*runs)


def _muon_engine(stage: int):
    from test_muon import _config, _model

    torch.manual_seed(0)
    eng, *_ = zero_offload.initialize(model=_model(), config=_config(stage, world=1))
    return eng


def _muon_step(eng, seed: int) -> None:
    from parity import batches, global_step

    (x, y), *_ = batches(1, 2, 2, 2, seed=seed)  # test_muon's global batch
    global_step(eng, x, y, 1, 0)


@pytest.mark.parametrize("stage", [1, 2])
def test_offload_states_with_muon_on_the_device_round_trips(stage):
    runs = []
    for offload in (False, True):
        eng = _muon_engine(stage)
        _muon_step(eng, 1)
        if offload:
            eng.offload_states()
            assert eng.offloaded_states()
            eng.reload_states()
        _muon_step(eng, 2)
        runs.append(_params(eng))
    _assert_same(*runs)


def test_a_storage_that_cannot_move_is_refused_before_anything_moves():
    eng = h.engine(2, False, "fp32")
    _step(eng)
    eng.module.a.weight.detach().numpy()  # a user's numpy view fixes the flat buffer's size
    with pytest.raises(
        EngineUsageError, match=r"offload_states\(\): (hp|lp)_params .*cannot be resized"
    ):
        eng.offload_states()
    assert not eng.offloaded_states()
    _step(eng, 2)  # the engine is whole
