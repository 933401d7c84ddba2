"""Issue: a finite 1e20 gradient element (its square overflows the float32 norm) was reported as
"gradients are not finite (inf/NaN)". The report names what was found."""

from __future__ import annotations

import logging

import pytest
import reliability_helpers as h


def _skip_with(eng, value: float) -> None:
    p = eng.module.a.weight
    handle = p.register_hook(
        lambda g: g.flatten().index_fill(0, g.new_tensor([3]).long(), value).view_as(g)
    )
    eng.backward(eng(h.batch().to(eng.dtype)))
    handle.remove()
    eng.step()


@pytest.mark.parametrize("stage,offload", [(0, False), (1, False), (2, True)])
def test_finite_huge_gradient_is_named(stage, offload, caplog):
    eng = h.engine(stage, offload, "fp32")
    caplog.set_level(logging.WARNING, logger="zero_offload")
    _skip_with(eng, 1e20)
    assert eng.skipped_steps == 1
    msg = caplog.records[-1].message
    assert "inf/NaN" not in msg and "every gradient element is finite" in msg
    assert "largest |g| is 1e+20" in msg


def test_inf_gradient_still_says_inf(caplog):
    eng = h.engine(2, False, "fp32")
    caplog.set_level(logging.WARNING, logger="zero_offload")
    _skip_with(eng, float("inf"))
    assert "gradients are not finite (inf/NaN)" in caplog.records[-1].message
