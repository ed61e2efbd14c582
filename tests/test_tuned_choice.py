"""The tuned shelves' one way to choose a configuration: interleaved rounds, fastest kept, per key."""

import pytest

from course_utils import env
from course_utils.tuned import choice


def test_first_candidate_without_a_gpu_or_with_one_candidate(monkeypatch):
    monkeypatch.setattr(env, "on_gpu", lambda: False)
    assert choice.fastest(["a", "b"], "k", lambda c: None, {}) == "a"
    monkeypatch.setattr(env, "on_gpu", lambda: True)
    assert choice.fastest(["only"], "k", lambda c: None, {}) == "only"


def test_interleaved_rounds_keep_each_candidates_best_time(monkeypatch):
    monkeypatch.setattr(env, "on_gpu", lambda: True)
    order, clock = [], iter([5.0, 3.0, 9.0, 1.0, 4.0, 8.0, 6.0, 7.0, 2.0])  # rounds of (a, b, c)
    cache: dict = {}

    def timer(fn):
        fn()
        return next(clock)
    got = choice.fastest(["a", "b", "c"], "key", order.append, cache, timer=timer)
    assert order == ["a", "b", "c"] + ["a", "b", "c"] * 3  # a compile-only warm-up, then interleaved rounds
    assert got == "a" and cache == {"key": "a"}         # a: min(5, 1, 6) = 1 beats b (3) and c (2)
    assert choice.TIMES["key"] == {"a": 1.0, "b": 3.0, "c": 2.0}  # what the choice saw, for a check to print
    assert choice.fastest(["a", "b", "c"], "key", order.append, cache, timer=timer) == "a"
    assert len(order) == 12                             # timed once per key


def test_every_candidate_is_compiled_before_the_first_timing(monkeypatch):
    monkeypatch.setattr(env, "on_gpu", lambda: True)
    events = []

    def timer(fn):
        events.append("timed")
        fn()
        return 1.0
    choice.fastest(["a", "b"], "warm", lambda c: events.append(c), {}, timer=timer, rounds=1)
    assert events[:2] == ["a", "b"] and events[2] == "timed"  # both compiled (launched untimed) first


def test_a_candidate_out_of_resources_is_skipped_and_other_errors_raise(monkeypatch):
    monkeypatch.setattr(env, "on_gpu", lambda: True)

    class OutOfResources(Exception):
        pass

    def launch(c):
        if c == "big":
            raise OutOfResources("out of resource: shared memory")
    assert choice.fastest(["big", "small"], 1, launch, {}, timer=lambda fn: fn() or 1.0) == "small"
    with pytest.raises(RuntimeError, match="no candidate"):
        choice.fastest(["big", "big2"], 2, lambda c: launch("big"), {}, timer=lambda fn: fn() or 1.0)

    def broken(c):
        raise ValueError("a real bug")
    with pytest.raises(ValueError, match="a real bug"):
        choice.fastest(["x", "y"], 3, broken, {}, timer=lambda fn: fn() or 1.0)
