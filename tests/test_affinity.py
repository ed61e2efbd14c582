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


def test_candidate_cores_split_the_allowed_cores_between_processes():
    allowed = sorted(os.sched_getaffinity(0))
    parts = [affinity.candidate_cores(i, 3) for i in range(3)]
    if len(allowed) >= 3:
        assert sorted(c for p in parts for c in p) == allowed   # every core once, no process shares one
    assert affinity.candidate_cores(0, 1) == allowed
    # more processes than cores: a process past the last core may use all of them (on any host size)
    assert affinity.candidate_cores(len(allowed) + 3, len(allowed) + 7) == allowed


def test_fastest_takes_the_shortest_loop_and_breaks_ties_towards_the_higher_core():
    assert affinity.fastest({0: 2.0, 1: 1.0, 2: 3.0}) == 1
    assert affinity.fastest({0: 1.0, 3: 1.0, 2: 1.0}) == 3


def test_one_core_probes_and_pins_to_the_core_it_reports(monkeypatch):
    allowed = sorted(os.sched_getaffinity(0))
    slowest_last = {c: 1.0 + i for i, c in enumerate(allowed)}   # the first allowed core is made the fastest
    monkeypatch.setattr(affinity, "core_speeds", lambda cores, rounds: {c: slowest_last[c] for c in cores})
    with affinity.one_core() as core:
        assert core == allowed[0] and os.sched_getaffinity(0) == {core}
        assert affinity.LAST_CHOICE["core"] == core and affinity.LAST_CHOICE["cores_probed"] == len(allowed)
    with affinity.one_core(probe=False) as core:
        assert core == affinity.pick_core(0)


def test_a_nested_block_chooses_among_all_the_allowed_cores(monkeypatch):
    seen = []

    def speeds(cores, rounds):
        seen.append(sorted(cores))
        return {c: 1.0 for c in cores}
    monkeypatch.setattr(affinity, "core_speeds", speeds)
    with affinity.one_core():
        with affinity.one_core() as inner:
            assert os.sched_getaffinity(0) == {inner}
    assert seen[0] == seen[1] == sorted(affinity.ALLOWED)


def test_core_speeds_inside_a_pinned_block_still_times_every_core_the_process_started_with():
    with affinity.one_core(probe=False):
        assert set(affinity.core_speeds(rounds=1, loop=10)) == set(affinity.ALLOWED)
