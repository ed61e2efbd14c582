"""course_utils.affinity: every thread on one core inside the block, the old masks back after it."""

import os
import threading

import pytest

from course_utils import affinity

pytestmark = pytest.mark.skipif(not affinity.supported(), reason="this system has no per-thread CPU affinity")


def _masks() -> dict:
    return {tid: os.sched_getaffinity(tid) for tid in affinity.thread_ids()}


def test_every_thread_pinned_inside_and_restored_after():
    stop = threading.Event()
    helper = threading.Thread(target=stop.wait, daemon=True)
    helper.start()   # a second thread that exists before the block, as the autograd engine's worker does
    try:
        before = _masks()
        with affinity.one_core() as core:
            inside = _masks()
            assert len(inside) >= 2
            assert all(mask == {core} for mask in inside.values()), inside
        after = _masks()
        assert all(after[tid] == before[tid] for tid in before if tid in after)
    finally:
        stop.set()
        helper.join()


def test_a_thread_started_inside_inherits_the_core():
    seen = {}
    with affinity.one_core() as core:
        t = threading.Thread(target=lambda: seen.update(mask=os.sched_getaffinity(0)))
        t.start()
        t.join()
    assert seen["mask"] == {core}


def test_pick_core_counts_down_from_the_last_allowed_core():
    allowed = sorted(os.sched_getaffinity(0))
    assert affinity.pick_core(0) == allowed[-1]
    assert affinity.pick_core(len(allowed)) == allowed[-1]   # wraps around on a host with fewer cores
    if len(allowed) > 1:
        assert affinity.pick_core(1) == allowed[-2]


@pytest.mark.parametrize("bad", [-1, 1.5])
def test_pick_core_refuses_a_bad_index(bad):
    with pytest.raises(ValueError, match="index must be an integer >= 0"):
        affinity.pick_core(bad)


def test_core_speeds_visits_each_allowed_core_and_restores_the_mask():
    if not affinity.supported():
        assert affinity.core_speeds() == {}
        return
    before = os.sched_getaffinity(0)
    speeds = affinity.core_speeds(rounds=2, loop=100)
    assert set(speeds) == before
    assert all(v > 0 for v in speeds.values())
    assert os.sched_getaffinity(0) == before
    one = min(before)
    assert set(affinity.core_speeds([one], rounds=1, loop=10)) == {one}
