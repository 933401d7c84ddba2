"""The accumulation window's rules (runtime/engine/window.py), without an engine."""

import pytest

from zero_offload.runtime.engine.guards import EngineUsageError
from zero_offload.runtime.engine.window import Window


def _micro_step(w: Window, steps: list[int]) -> tuple[bool, bool]:
    """One backward then step() at counters steps = [global, micro]; returns (first, last)."""
    assert not w.reopens()
    first, last = w.begin_backward(*steps)
    w.end_backward()
    w.begin_step(steps[0])
    steps[0] += last  # the engine's boundary step moves global_steps
    steps[1] += 1
    return first, last


def test_counter_ends_every_gas_th_micro_step():
    w, steps = Window(gas=3), [0, 0]
    assert [_micro_step(w, steps) for _ in range(6)] == [
        (True, False),
        (False, False),
        (False, True),
    ] * 2


def test_override_and_no_sync_decide_the_end():
    w = Window(gas=1)
    w.boundary_override = False
    assert w.begin_backward(0, 0) == (True, False)
    w.boundary_override = None
    w.inside_no_sync = True
    assert w.begin_backward(0, 0) == (False, False)  # the window was touched: not its start


def test_second_backward_after_the_end_reopens_and_step_without_backward_raises():
    w = Window(gas=1)
    with pytest.raises(EngineUsageError):
        w.begin_step(0)
    w.begin_backward(0, 0)
    w.end_backward()
    assert w.reopens()  # another backward before step(): it adds and ends the window again
    assert w.begin_backward(0, 0) == (False, True)
    w.end_backward()
    w.begin_step(0)
    assert not w.reopens()
    w.inside_no_sync = True
    with pytest.raises(RuntimeError, match="no_sync"):
        w.begin_step(0)


def test_unmanaged_window_ends_only_inside_step():
    w = Window(gas=1, managed=False)
    assert w.begin_backward(0, 0) == (True, False)
    assert w.backwards == 1
    w.in_step = True
    assert w.is_boundary(0, 0)


def test_restart_and_moved_counters_start_a_new_window():
    w = Window(gas=2)
    w.begin_backward(0, 0)
    assert not w.at_start(0, 1)
    w.restart(0, 1)
    assert w.at_start(0, 1) and not w.is_boundary(0, 1)
    assert w.at_start(5, 7)  # a load moved global_steps: the window starts at micro step 7
