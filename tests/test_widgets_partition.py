"""The BLOCK_SIZE partition widget (chapter 3): pure functions, and the widget driven headlessly."""

from __future__ import annotations

import random
import re

import pytest

from course_utils import hardware
from course_utils.widgets import partition as P

pytestmark = pytest.mark.machinery   # left out of the newest-Triton run (pyproject.toml says why)


def test_partition_covers_every_element_once_with_the_fewest_programs():
    rng = random.Random()
    for _ in range(200):
        n = rng.randrange(0, 100_000)
        b = 2 ** rng.randrange(0, 13)
        tiles = P.partition(n, b)
        assert len(tiles) == P.n_programs(n, b) == -(-n // b)
        covered = [i for t in tiles for i in range(t.start, t.stop)] if n < 3000 else None
        if covered is not None:
            assert covered == list(range(n))
        assert all(t.pid == k and t.start == k * b for k, t in enumerate(tiles))
        assert all(t.masked == 0 for t in tiles[:-1])
        if tiles:
            assert tiles[-1].live + tiles[-1].masked == b
            assert tiles[-1].masked == (-n) % b


def test_summary_numbers():
    s = P.summary(1000, 128, sms=132)
    assert s["grid"] == 8 and s["full_tiles"] == 7 and s["last_live"] == 104 and s["masked_lanes"] == 24
    assert s["waves"] == 1
    grid = -(-(10**6) // 64)
    assert P.summary(10**6, 64, sms=108)["waves"] == -(-grid // 108)
    assert P.summary(0, 64)["grid"] == 0


@pytest.mark.parametrize("bad", [(-1, 8), (10, 0), (10, 2.5), (True, 8)])
def test_bad_arguments(bad):
    with pytest.raises(ValueError):
        P.partition(*bad)


def test_render_marks_masked_lanes_and_pids():
    out = P.render(10, 4)
    assert out.count("mask is False") == 2            # lanes 10 and 11 of pid 2
    assert "pid 2" in out and "pid 3" not in out
    assert "grid = cdiv(10, 4) = 3" in out
    big = P.render(1_000_000, 4096, sms=132)
    assert "one cell = " in big and big.count("<span") <= P.MAX_CELLS


def test_widget_follows_its_controls():
    w = P.PartitionWidget(n_elements=1000, block_size=128)
    assert set(w.controls) == {"n_elements", "BLOCK_SIZE", "gpu"}
    assert "= 8 program instances" in w.output.value
    w.controls["BLOCK_SIZE"].value = 256
    assert "= 4 program instances" in w.output.value
    w.controls["n_elements"].value = 1024
    assert w.state()["masked_lanes"] == 0 and "masked lanes" not in w.output.value
    w.controls["gpu"].value = "t4"
    assert f"On {hardware.SPECS['t4'].sms} SMs" in w.output.value
    assert re.search(r"1 wave", w.output.value)
    assert w.render() == w.output.value
