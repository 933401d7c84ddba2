"""Item: skipped steps are reported, and a run that cannot recover stops with a clear error."""

from __future__ import annotations

import logging

import pytest
import reliability_helpers as h

from zero_offload.runtime.precision.overflow import OverflowMonitor, OverflowStopError


def _nan_steps(eng, n: int) -> None:
    for _ in range(n):
        eng.backward(eng(h.batch().to(eng.dtype)) * float("nan"))
        eng.step()


@pytest.mark.parametrize("stage,offload", [(0, False), (2, True)])
def test_fp16_at_min_scale_stops(stage, offload, caplog):
    eng = h.engine(
        stage,
        offload,
        "fp16",
        fp16={"enabled": True, "initial_scale_power": 3, "hysteresis": 1},
        max_consecutive_overflows=4,
    )
    caplog.set_level(logging.WARNING, logger="zero_offload")
    # scale 8 -> 4 -> 2 -> 1 (three skips above the minimum), then four skips at it.
    _nan_steps(eng, 3 + 3)
    assert eng.loss_scale == 1.0 and eng.skipped_steps == 6
    with pytest.raises(OverflowStopError, match="4 consecutive.*already at minimum"):
        _nan_steps(eng, 1)
    assert any("step 1 skipped: gradients are not finite" in r.message for r in caplog.records)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_non_finite_steps_stop_without_loss_scaling(dtype):
    eng = h.engine(2, False, dtype, max_consecutive_overflows=3)
    _nan_steps(eng, 2)
    eng.backward(eng(h.batch().to(eng.dtype)))  # a good step resets the count
    eng.step()
    _nan_steps(eng, 2)
    with pytest.raises(OverflowStopError, match="3 consecutive.*no loss scale to lower"):
        _nan_steps(eng, 1)


def test_zero_limit_never_stops():
    eng = h.engine(0, False, "fp32", max_consecutive_overflows=0)
    _nan_steps(eng, 12)
    assert eng.skipped_steps == 12


def test_every_skip_is_reported_rate_limited(caplog):
    mon = OverflowMonitor(dynamic=True, min_scale=1.0, limit=0, rank=0, interval=3600)
    caplog.set_level(logging.WARNING, logger="zero_offload")
    for step in range(1, 6):
        mon.after_step(True, 8.0, 4.0, step)
    assert len(caplog.records) == 1  # one line per interval
    mon.interval = 0
    mon.after_step(True, 4.0, 2.0, 6)
    assert "(5 skipped since the last report)" in caplog.records[-1].message
