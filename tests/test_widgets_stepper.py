"""The online-softmax stepper: its pure functions, and the widget driven headlessly."""

from __future__ import annotations

import math

import numpy as np
import pytest

from course_utils.widgets import stepper


def _exact(x):
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.mark.parametrize("n, block", [(1, 1), (7, 3), (24, 4), (25, 6), (100, 100), (31, 50)])
def test_trace_ends_with_the_exact_statistics(n, block):
    x = np.random.default_rng().standard_normal(n) * 7 + 40
    steps = stepper.trace(x, block)
    assert len(steps) == math.ceil(n / block)
    assert steps[-1]["m_new"] == x.max()
    assert steps[-1]["s_new"] == pytest.approx(np.exp(x - x.max()).sum(), rel=1e-12)
    for a, b in zip(steps, steps[1:]):
        assert b["m_old"] == a["m_new"] and b["s_old"] == a["s_new"]
        assert b["correction"] == pytest.approx(math.exp(b["m_old"] - b["m_new"]))
        assert (b["correction"] == 1.0) == (b["m_new"] == b["m_old"])


def test_first_tile_has_nothing_to_rescale_and_minus_inf_tiles_change_nothing():
    x = np.array([-np.inf] * 4 + [1.0, 3.0, 2.0, -np.inf, 0.5])
    steps = stepper.trace(x, 4)
    assert steps[0]["m_new"] == -np.inf and steps[0]["s_new"] == 0.0
    assert steps[1]["correction"] == 0.0 and steps[1]["m_new"] == 3.0
    st = stepper.state(x, 4, 99)
    assert st["done"] and st["step"] == 3
    np.testing.assert_allclose(st["partial"], _exact(x), atol=1e-15)


def test_state_partial_results_and_clipping():
    x = stepper.row(24, seed=3)
    st0 = stepper.state(x, 4, 0)
    assert st0["seen"] == 0 and np.isnan(st0["partial"]).all() and not st0["done"]
    st2 = stepper.state(x, 4, 2)
    assert st2["seen"] == 8 and np.isnan(st2["partial"][8:]).all()
    m, s = x[:8].max(), np.exp(x[:8] - x[:8].max()).sum()
    np.testing.assert_allclose(st2["partial"][:8], np.exp(x[:8] - m) / s)
    assert st2["max_abs_error"] > 1e-6       # not the softmax yet: later tiles raise m (the row rises)
    last = stepper.state(x, 4, 10**6)
    assert last["step"] == 6 and last["done"] and last["max_abs_error"] < 1e-12
    assert stepper.state(x, 4, -5)["step"] == 0


def test_rising_row_moves_the_max_often():
    steps = stepper.trace(stepper.row(24), 4)
    assert sum(s["correction"] < 1 for s in steps[1:]) >= 2


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "4"])
def test_bad_block_raises(bad):
    with pytest.raises(ValueError, match="block"):
        stepper.trace(np.ones(4), bad)


def test_bad_rows_raise():
    with pytest.raises(ValueError):
        stepper.trace(np.ones((2, 2)), 2)
    with pytest.raises(ValueError):
        stepper.trace(np.array([]), 2)
    with pytest.raises(ValueError):
        stepper.row(0)


def test_render_shows_the_numbers_of_the_state():
    x = stepper.row(12, seed=1)
    st = stepper.state(x, 4, 2)
    html = stepper.render(x, 4, st)
    last = st["last"]
    assert "Tile 2 of 3" in html
    assert stepper._fmt(last["m_new"]) in html and stepper._fmt(last["s_new"]) in html
    assert stepper._fmt(last["correction"]) in html
    assert "exact softmax" in stepper.render(x, 4, stepper.state(x, 4, 3))


def test_widget_slider_play_and_block():
    pytest.importorskip("ipywidgets")
    w = stepper.OnlineSoftmaxStepper(n=10, block=3)
    assert w.step.max == w.play.max == 4
    assert "Nothing read yet" in w.view.value
    w.step.value = 2
    assert "Tile 2 of 4" in w.view.value and w.state()["seen"] == 6
    w.step.value = 4
    assert "equals the exact softmax" in w.view.value and w.state()["done"]
    w.block_size.value = 2
    assert w.step.value == 0 and w.step.max == w.play.max == 5
    assert "Nothing read yet" in w.view.value
    assert len(w.controls) == 3
    assert w.render() == w.view.value
