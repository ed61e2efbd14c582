"""The tile-schedule widget: its pure functions and the widget driven headlessly."""

from __future__ import annotations

import math

import numpy as np
import pytest

from course_utils import traffic
from course_utils.widgets import tiles


def test_schedule_full_has_only_ragged_masks():
    kinds = tiles.schedule(10, 4, 4, causal=False)
    assert len(kinds) == 3 and all(len(r) == 3 for r in kinds)
    assert all(r[:2] == [tiles.FULL, tiles.FULL] and r[2] == tiles.MASKED for r in kinds)
    assert all(k == tiles.FULL for r in tiles.schedule(8, 4, 4, False) for k in r)


def test_schedule_causal_skips_above_diagonal_and_masks_it():
    kinds = tiles.schedule(16, 4, 4, causal=True)
    for i, row in enumerate(kinds):
        for j, k in enumerate(row):
            assert k == (tiles.SKIPPED if j > i else tiles.MASKED if j == i else tiles.FULL)
    # rectangular tiles: BLOCK_M = 8, BLOCK_N = 4 -> both K/V tiles under a query tile's diagonal are masked
    assert tiles.schedule(16, 8, 4, True) == [[tiles.MASKED, tiles.MASKED, tiles.SKIPPED, tiles.SKIPPED],
                                              [tiles.FULL, tiles.FULL, tiles.MASKED, tiles.MASKED]]


@pytest.mark.parametrize("n,bm,bn", [(37, 8, 4), (40, 8, 8), (13, 16, 4)])
def test_visited_kv_rows_agree_with_traffic(n, bm, bn):
    # with BLOCK_N dividing BLOCK_M the kernel loads exactly the K/V rows traffic.py counts
    kinds = tiles.schedule(n, bm, bn, True)
    rows = sum(min(n, (j + 1) * bn) - j * bn for row in kinds for j, k in enumerate(row) if k != tiles.SKIPPED)
    assert rows == traffic.flash_kv_rows(n, bm, True)


def test_online_trace_ends_at_true_max_and_sum():
    rng = np.random.default_rng()
    row = rng.standard_normal(23) * 30
    m, l_sum = tiles.online_trace(row, 5)[-1]
    assert m == row.max()
    assert math.isclose(l_sum, np.exp(row - row.max()).sum(), rel_tol=1e-12)
    m, l_sum = tiles.online_trace(row, 5, query=6)[-1]  # causal: keys 0..6 only
    assert m == row[:7].max() and math.isclose(l_sum, np.exp(row[:7] - row[:7].max()).sum(), rel_tol=1e-12)
    ms = [t[0] for t in tiles.online_trace(row, 4)]
    assert ms == sorted(ms)  # the running max never decreases


def test_state_steps_and_sram():
    st = tiles.state(20, 4, 4, True, query_tile=2, step=0)
    assert st["current"] is None and st["visit"] == [0, 1, 2] and st["rows"][0]["m"] == -math.inf
    st = tiles.state(20, 4, 4, True, query_tile=2, step=2)
    assert st["current"] == 1 and st["done"] == [0] and st["in_sram"] == {"q_tile": 2, "kv_tile": 1}
    assert tiles.state(20, 4, 4, True, 2, 99)["step"] == 3  # clipped
    last = tiles.state(20, 4, 4, True, 2, 3)
    assert all(r["m"] == r["final_m"] and r["l"] == r["final_l"] for r in last["rows"])
    assert last["tiles_skipped"] == 10 and last["tiles_total"] == 25
    with pytest.raises(ValueError, match="query_tile"):
        tiles.state(20, 4, 4, True, 5, 0)
    with pytest.raises(ValueError, match="block_m"):
        tiles.schedule(20, 0, 4, True)


def test_widget_headless():
    wdg = tiles.TileSchedule(seq_len=24, block_m=8, block_n=8, causal=True)
    c = wdg.controls
    assert c["query_tile"].max == 2 and c["step"].max == 1
    c["query_tile"].value = 2
    assert c["step"].max == 3 and wdg.play.max == 3
    c["step"].value = 2
    assert "step 2 of 3" in wdg.output.value and "K/V tile 1 and query tile 2 are in SRAM" in wdg.output.value
    assert wdg.output.value.count(">skip<") == 3
    c["causal"].value = False
    assert wdg.output.value.count(">skip<") == 0 and c["step"].max == 3
    c["block_m"].value = 4
    assert c["query_tile"].max == 5
    assert wdg.render() == wdg.output.value
