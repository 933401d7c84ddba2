"""Items: stale or lost gradients (step/backward pairing), and API misuse with clear errors."""

from __future__ import annotations

import pytest
import reliability_helpers as h
import torch

from zero_offload.runtime.engine.guards import EngineUsageError, NonFiniteHyperparameterError

PLACEMENTS = [(0, False), (1, False), (2, False), (1, True), (2, True)]


@pytest.mark.parametrize("stage,offload", PLACEMENTS)
@pytest.mark.parametrize("gas", [1, 2])
def test_step_without_backward_raises(stage, offload, gas):
    eng = h.engine(stage, offload, gradient_accumulation_steps=gas)
    for _ in range(gas):
        eng.backward(eng(h.batch()))
        eng.step()
    before = [p.detach().clone() for p in eng.module.parameters()]
    with pytest.raises(EngineUsageError, match=r"step\(\) with no engine.backward\(\)"):
        eng.step()
    for p, b in zip(eng.module.parameters(), before):  # nothing re-applied
        assert torch.equal(p.detach(), b)
    eng.backward(eng(h.batch()))  # still usable afterwards
    eng.step()


@pytest.mark.parametrize("stage,offload", PLACEMENTS + [(3, False), (3, True)])
def test_backwards_after_the_window_ended_accumulate_like_torch(stage, offload):
    """A second and third backward after the one that ended the window, before step(): their
    gradients add up, as one backward of the summed losses (tests/test_two_backwards.py
    compares the trained params)."""
    ref = h.net()
    (ref(h.batch(1)) + ref(h.batch(2)) + ref(h.batch(3))).backward()
    want = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in ref.parameters())).item()
    eng = h.engine(stage, offload)
    for seed in (1, 2, 3):
        eng.backward(eng(h.batch(seed)))
    eng.step()
    assert eng.get_global_grad_norm() == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("stage,offload", PLACEMENTS)
def test_backward_reopening_the_window_must_end_it(stage, offload):
    """After the window's end, a backward that would not end it again (no_sync, boundary
    override False) is refused before it runs; the step then has the first backward's
    gradient alone."""
    ref = h.net()
    ref(h.batch(1)).backward()
    want = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in ref.parameters())).item()
    eng = h.engine(stage, offload)
    eng.backward(eng(h.batch(1)))
    eng.set_gradient_accumulation_boundary(False)
    with pytest.raises(EngineUsageError, match="must end the window again"):
        eng.backward(eng(h.batch(2)))
    eng.set_gradient_accumulation_boundary(True)
    eng.step()
    assert eng.get_global_grad_norm() == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("stage,offload", PLACEMENTS)
def test_summed_losses_give_torch_gradients(stage, offload):
    """The documented way to combine two losses: one backward of their sum (as torch)."""
    ref = h.net()
    (ref(h.batch(1)) + ref(h.batch(2))).backward()
    want = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in ref.parameters())).item()
    eng = h.engine(stage, offload)
    eng.backward(eng(h.batch(1)) + eng(h.batch(2)))
    eng.step()
    assert eng.get_global_grad_norm() == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("stage,offload", PLACEMENTS + [(3, False), (3, True)])
def test_non_boundary_backwards_accumulate_like_torch(stage, offload):
    """Before the last micro-step of a window, backward() may run more than once: the
    gradients add up, on every stage and placement, as one backward of the summed losses."""
    ref = h.net()
    (ref(h.batch(1)) + ref(h.batch(2)) + ref(h.batch(3))).div(2).backward()
    want = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in ref.parameters())).item()
    eng = h.engine(stage, offload, gradient_accumulation_steps=2)
    eng.backward(eng(h.batch(1)))
    eng.backward(eng(h.batch(2)))  # same, non-boundary micro-step: accumulates
    eng.step()
    eng.backward(eng(h.batch(3)))
    eng.step()
    assert eng.get_global_grad_norm() == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("bad", [1.0, 3, None, "loss"])
def test_backward_of_a_non_tensor_says_what_to_pass(bad):
    eng = h.engine()
    with pytest.raises(TypeError, match="loss must be the scalar torch.Tensor"):
        eng.backward(bad)


def test_backward_of_a_detached_or_vector_loss():
    eng = h.engine()
    with pytest.raises(ValueError, match="does not require grad"):
        eng.backward(eng(h.batch()).detach())
    with pytest.raises(ValueError, match="must be a scalar"):
        eng.backward(torch.ones(3, requires_grad=True))


def _stage_config(stage: int) -> dict:
    cfg = h.config(stage)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    return cfg


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_initialize_twice_on_one_model(stage, caplog):
    """A second initialize() takes the model over from an engine that was not destroyed (at
    stage 3 a dropped engine stays alive through the model's hooks), with a warning; the old
    engine then refuses to run. Both train from the same weights."""
    import gc

    import zero_offload

    model = h.net()
    eng, _, _, _ = zero_offload.initialize(model=model, config=_stage_config(stage))
    eng.backward(eng(h.batch()))
    eng.step()
    from zero_offload.utils import safe_get_full_fp32_param

    trained = [safe_get_full_fp32_param(p) for p in model.parameters()]
    with caplog.at_level("WARNING", logger="zero_offload"):
        eng2, _, _, _ = zero_offload.initialize(model=model, config=_stage_config(stage))
    assert "not destroyed; destroying it" in caplog.text
    with pytest.raises(EngineUsageError, match=r"engine.forward\(\) after engine.destroy"):
        eng(h.batch())
    with pytest.raises(EngineUsageError, match=r"engine.step\(\) after engine.destroy"):
        eng.step()
    assert all(  # the new engine starts from the old one's weights
        torch.equal(safe_get_full_fp32_param(p), t) for p, t in zip(model.parameters(), trained)
    )
    del eng
    gc.collect()
    eng2.backward(eng2(h.batch()))
    eng2.step()
    eng2.destroy()
    eng2.destroy()  # a second destroy does nothing
    with pytest.raises(EngineUsageError, match="after engine.destroy"):
        eng2.backward(eng2.module(h.batch()) if stage < 3 else torch.ones((), requires_grad=True))


class _InfLR(torch.optim.lr_scheduler.LRScheduler):
    def get_lr(self):
        return [
            float("inf") if self.last_epoch >= 1 else g["lr"] for g in self.optimizer.param_groups
        ]


@pytest.mark.parametrize("stage,offload", [(0, False), (2, True)])
def test_scheduler_producing_inf_stops_before_the_update(stage, offload):
    import zero_offload

    model = h.net()
    eng, _, _, _ = zero_offload.initialize(
        model=model, config=h.config(stage, offload), lr_scheduler=lambda opt: _InfLR(opt)
    )
    eng.backward(eng(h.batch()))
    eng.step()  # the scheduler now sets lr = inf
    before = [p.detach().clone() for p in model.parameters()]
    eng.backward(eng(h.batch()))
    with pytest.raises(NonFiniteHyperparameterError, match=r"param_groups\[0\]\['lr'\] is inf"):
        eng.step()
    for p, b in zip(model.parameters(), before):
        assert torch.isfinite(p).all() and torch.equal(p.detach(), b)
