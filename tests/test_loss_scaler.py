"""Dynamic loss scaling follows DeepSpeed's schedule."""

from __future__ import annotations

from zero_offload.runtime.precision.loss_scaler import DynamicLossScaler, LossScaler


def test_hysteresis_then_halve_and_floor():
    s = DynamicLossScaler(init_scale=8.0, scale_window=1000, min_scale=2.0, delayed_shift=2)
    s.update_scale(True)  # absorbed by hysteresis
    assert s.loss_scale == 8.0
    s.update_scale(True)
    assert s.loss_scale == 4.0
    s.update_scale(True)
    assert s.loss_scale == 2.0
    s.update_scale(True)
    assert s.loss_scale == 2.0  # never below min_loss_scale


def test_grows_after_window_of_clean_steps():
    s = DynamicLossScaler(init_scale=4.0, scale_window=3, delayed_shift=1)
    s.update_scale(True)  # iter 0 overflow -> 2
    assert s.loss_scale == 2.0
    for _ in range(2):
        s.update_scale(False)
    assert s.loss_scale == 2.0
    s.update_scale(False)  # third clean iteration since the overflow
    assert s.loss_scale == 4.0


def test_hysteresis_resets_after_window():
    s = DynamicLossScaler(init_scale=16.0, scale_window=2, delayed_shift=2)
    s.update_scale(True)  # hysteresis 2 -> 1
    s.update_scale(False)
    s.update_scale(False)  # window passed: scale doubles, hysteresis restored to 2
    assert s.loss_scale == 32.0 and s.cur_hysteresis == 2
    s.update_scale(True)
    assert s.loss_scale == 32.0


def test_static_and_state_roundtrip():
    st = LossScaler(128.0)
    st.update_scale(True)
    assert st.loss_scale == 128.0
    d = DynamicLossScaler(init_scale=8.0)
    d.update_scale(True)
    e = DynamicLossScaler(init_scale=1.0)
    e.load_state_dict(d.state_dict())
    assert e.state_dict() == d.state_dict()
