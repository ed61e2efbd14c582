"""Chapter 1: the launch kernels, the simulated CUDA graph, and the checkers of both exercises.

Every checker must pass the reference answer and fail each usual wrong answer with a message that
names the missing step.
"""

from __future__ import annotations

import time

import pytest
import torch

import course_utils as cu
from course_utils import check
from course_utils.checkers import timing
from course_utils.checkers.timing import CheckFailure, FakeDevice, check_graphed, check_time_call
from course_utils.kernels import launch
from course_utils.kernels.launch import CUDAGraph, graph
from course_utils.profile import count_launches

DEV = cu.DEVICE


# --- the launch kernels ---------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 7, 1000, 4099])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_add_one_matches_float64_reference_on_odd_sizes(n, dtype):
    x = check.randn((n,), dtype, offset=-0.5)
    out = check.Guarded((n,), dtype)  # NaN-poisoned, guard zones around it
    got = launch.add_one(x, out=out.tensor, BLOCK_SIZE=256)
    out.check("add_one")
    assert got is out.tensor
    check.compare("add_one", got, x.to(torch.float64) + 1, dtype=dtype)


def test_add_one_empty_input_returns_empty_without_a_launch():
    x = torch.empty(0, device=DEV)
    counts = count_launches(launch.add_one, x)
    assert counts.total == 0, counts  # an allocation launches nothing, and neither does add_one
    assert launch.add_one(x).numel() == 0


def test_add_one_is_one_launch():
    x = check.randn((1000,))
    launch.add_one(x)
    assert count_launches(launch.add_one, x).total == 1


@pytest.mark.parametrize("bad, err", [
    (lambda: launch.add_one([1.0, 2.0]), TypeError),
    (lambda: launch.add_one(torch.ones(4, dtype=torch.int32, device=DEV)), TypeError),
    (lambda: launch.add_one(torch.ones(4, 4, device=DEV).t()), ValueError),
    (lambda: launch.add_one(torch.ones(4, device=DEV), out=torch.empty(5, device=DEV)), ValueError),
    (lambda: launch.add_one(torch.ones(4, device="meta")), ValueError),
    (lambda: launch.empty10(*[torch.ones(1, device=DEV)] * 9), ValueError),
    (lambda: launch.chain_ref(torch.ones(3, device=DEV), 0), ValueError),
])
def test_bad_inputs_raise_clear_errors(bad, err):
    with pytest.raises(err):
        bad()


def test_empty_kernels_launch_once_and_touch_nothing():
    x = check.randn((5,))
    before = x.clone()
    assert count_launches(launch.empty, x).total == 1
    assert count_launches(launch.empty10, *[x] * 10).total == 1
    assert torch.equal(x, before)


def test_chain_ref_counts_one_launch_per_op():
    x = check.randn((9,))
    for n in (1, 4, 7):
        assert count_launches(launch.chain_ref, x, n).total == n


def test_host_us_per_call_rejects_bad_counts():
    with pytest.raises(ValueError):
        launch.host_us_per_call(lambda: None, calls=0)
    assert launch.host_us_per_call(lambda: None, calls=10, warmup=0) >= 0


# --- the simulated graph keeps a real graph's rules ------------------------------------------------

@pytest.mark.skipif(cu.on_gpu(), reason="the simulation is what runs without a GPU")
def test_simulated_graph_rules():
    static_x = check.randn((3, 5))
    g = CUDAGraph()
    assert isinstance(g, launch.SimulatedGraph)
    with graph(g):
        out = launch.chain_ref(static_x, 4)
    assert out.isnan().all(), "capture runs nothing: the output holds garbage until a replay"
    x = check.randn((3, 5))
    static_x.copy_(x)
    g.replay()
    torch.testing.assert_close(out, launch.chain_ref(x, 4))  # values copied in are seen
    kept = out.clone()
    y = check.randn((3, 5))
    g.replay()  # a new tensor y was never copied in: the replay still reads static_x
    torch.testing.assert_close(out, kept)
    static_x.copy_(y)
    g.replay()
    torch.testing.assert_close(out, launch.chain_ref(y, 4))  # and the same output tensor is overwritten
    assert count_launches(g.replay).total == 0  # one replay: no op is launched one by one
    with pytest.raises(RuntimeError):
        with graph(g):
            pass


@pytest.mark.skipif(cu.on_gpu(), reason="the simulation is what runs without a GPU")
def test_simulated_graph_replays_triton_launches_and_refuses_replay_before_capture():
    with pytest.raises(RuntimeError):
        CUDAGraph().replay()
    static_x, out = check.randn((37,)), torch.empty(37, device=DEV)
    g = CUDAGraph()
    with graph(g):
        launch.add_one(static_x, out=out, BLOCK_SIZE=16)
    x = check.randn((37,))
    static_x.copy_(x)
    g.replay()
    torch.testing.assert_close(out, x + 1)
    with pytest.raises(TypeError):
        graph(object())


# --- exercise 1: time_call ------------------------------------------------------------------------

def test_fake_device_is_asynchronous():
    dev = FakeDevice(launch_us=5, work_us=50, compile_us=1000)
    dev.fn()
    assert dev.clock() == pytest.approx(1005e-6)  # the host is back after compile + launch
    dev.sync()
    assert dev.clock() == pytest.approx(1055e-6)  # the work is done only after a sync
    for _ in range(10):
        dev.fn()
    dev.sync()
    assert dev.clock() == pytest.approx(1055e-6 + 5e-6 + 10 * 50e-6)  # queued work overlaps launches


def good(fn, warmup=10, reps=100, sync=None, clock=time.perf_counter):
    for _ in range(warmup):
        fn()
    sync()
    t0 = clock()
    for _ in range(reps):
        fn()
    sync()
    return (clock() - t0) / reps * 1e6


def no_final_sync(fn, warmup, reps, sync, clock):
    for _ in range(warmup):
        fn()
    sync()
    t0 = clock()
    for _ in range(reps):
        fn()
    return (clock() - t0) / reps * 1e6


def no_warmup(fn, warmup, reps, sync, clock):
    sync()
    t0 = clock()
    for _ in range(warmup + reps):
        fn()
    sync()
    return (clock() - t0) / (warmup + reps) * 1e6


def no_sync_after_warmup(fn, warmup, reps, sync, clock):
    for _ in range(warmup):
        fn()
    t0 = clock()
    for _ in range(reps):
        fn()
    sync()
    return (clock() - t0) / reps * 1e6


def sync_every_call(fn, warmup, reps, sync, clock):
    for _ in range(warmup):
        fn()
    sync()
    t0 = clock()
    for _ in range(reps):
        fn()
        sync()
    return (clock() - t0) / reps * 1e6


def own_clock(fn, warmup, reps, sync, clock):
    return good(fn, warmup, reps, sync, time.perf_counter)


def in_seconds(fn, warmup, reps, sync, clock):
    return good(fn, warmup, reps, sync, clock) * 1e-6


def not_divided(fn, warmup, reps, sync, clock):
    return good(fn, warmup, reps, sync, clock) * reps


def off_by_a_bit(fn, warmup, reps, sync, clock):
    return good(fn, warmup, reps, sync, clock) * 1.1


def stub(fn, warmup, reps, sync, clock):
    raise NotImplementedError("Exercise: replace this line with your code")


def test_time_call_reference_passes(capsys):
    check_time_call(good)
    assert capsys.readouterr().out.startswith("PASS time_call:")


def test_time_call_calling_the_answer_key_fails():
    """Issue 17: the course's reference timer is the answer the check compares with."""
    ref = timing.reference_time_call

    def wrapper(fn, warmup=10, reps=100, sync=None, clock=None):
        return ref(fn, warmup, reps, sync, clock)
    for answer in (timing.reference_time_call, wrapper):
        with pytest.raises(CheckFailure, match="reference timer"):
            check_time_call(answer)


def test_time_call_stub_raises_not_implemented():
    with pytest.raises(NotImplementedError):
        check_time_call(stub)
    with pytest.raises(CheckFailure):
        check_time_call(42)


def test_each_missing_step_changes_the_measured_time_a_lot():
    """The pretend devices are chosen so that every mistake is off by far more than the tolerance."""
    for wrong in (no_final_sync, no_warmup, no_sync_after_warmup, sync_every_call):
        worst = 0.0
        for launch_us, work_us, warmup, reps in [(5, 60, 5, 100), (5, 450, 10, 20), (9, 2, 5, 100)]:
            dev, ref = FakeDevice(launch_us, work_us, 3e4), FakeDevice(launch_us, work_us, 3e4)
            got = wrong(dev.fn, warmup, reps, dev.sync, dev.clock)
            want = good(ref.fn, warmup, reps, ref.sync, ref.clock)
            worst = max(worst, abs(got - want) / want)
        assert worst > 0.2, wrong.__name__


# --- exercise 2: make_graphed ---------------------------------------------------------------------

def make_graphed(fn, example_x):
    static_x = example_x.clone()
    fn(static_x)
    g = CUDAGraph()
    with graph(g):
        static_out = fn(static_x)

    def run(x):
        if x.shape != static_x.shape or x.dtype != static_x.dtype:
            raise ValueError("new shape")
        static_x.copy_(x)
        g.replay()
        return static_out.clone()
    return run


def _variant(copy_in=True, replay=True, clone=True, shape_check="full", eager=False):
    def make(fn, example_x):
        if eager:
            return lambda x: fn(x) if x.shape == example_x.shape else (_ for _ in ()).throw(ValueError())
        static_x = example_x.clone()
        fn(static_x)
        g = CUDAGraph()
        with graph(g):
            static_out = fn(static_x)

        def run(x):
            if shape_check == "len" and len(x) != len(static_x):
                raise ValueError("new length")
            if shape_check in ("shape", "full") and x.shape != static_x.shape:
                raise ValueError("new shape")
            if shape_check == "full" and x.dtype != static_x.dtype:
                raise ValueError("new dtype")
            if copy_in:
                static_x.copy_(x)
            if replay:
                g.replay()
            return static_out.clone() if clone else static_out
        return run
    return make


def test_make_graphed_reference_passes(capsys):
    check_graphed(make_graphed)
    assert capsys.readouterr().out.startswith("PASS make_graphed:")


@pytest.mark.parametrize("wrong, says", [
    (_variant(copy_in=False), "copy the new values into it"),
    (_variant(clone=False), "return a copy"),
    (_variant(shape_check=False), "must raise ValueError|accepted x of shape"),
    (_variant(shape_check="len"), "checking len.x. is not enough"),        # issue 17, 1.2
    (_variant(shape_check="shape"), "dtype float64"),
    (_variant(eager=True), "one by one"),
] + ([] if cu.on_gpu() else [(_variant(replay=False), "replay")]))
def test_make_graphed_wrong_answers_fail_and_say_why(wrong, says):
    with pytest.raises(CheckFailure, match=says):
        check_graphed(wrong)


def test_make_graphed_wrong_error_type_and_crashes_fail():
    def wrong_error(fn, example_x):
        run = make_graphed(fn, example_x)
        return lambda x: run(x) if x.shape == example_x.shape else (_ for _ in ()).throw(TypeError())
    with pytest.raises(CheckFailure, match="must raise ValueError"):
        check_graphed(wrong_error)

    def crashes(fn, example_x):
        raise KeyError("oops")
    with pytest.raises(CheckFailure, match="KeyError"):
        check_graphed(crashes)

    def stub(fn, example_x):
        raise NotImplementedError("make_graphed: replace this line with your code")
    with pytest.raises(NotImplementedError):
        check_graphed(stub)


def test_verdicts_are_deterministic(capsys):
    """Check cells are compared with their saved output: the verdict must not vary between runs."""
    outs = set()
    for _ in range(3):
        check_time_call(good)
        check_graphed(make_graphed)
        outs.add(capsys.readouterr().out)
    assert len(outs) == 1
    assert not any(ch.isdigit() for ch in outs.pop().replace("3 pretend", ""))


def test_make_graphed_by_the_course_helper_is_refused():
    from course_utils import graphs

    def make_graphed(fn, example_x):
        replay = graphs.capture(lambda: fn(example_x))
        return lambda x: replay()
    with pytest.raises(CheckFailure, match="graphs.capture"):
        check_graphed(make_graphed)


def test_time_call_with_the_default_counts_fixed_is_named():
    def fixed_counts(fn, warmup=10, reps=100, sync=None, clock=time.perf_counter):
        for _ in range(10):
            fn()
        sync()
        t0 = clock()
        for _ in range(100):
            fn()
        sync()
        return (clock() - t0) / 100 * 1e6
    with pytest.raises(CheckFailure, match="the defaults: loop over the warmup and reps you were given"):
        check_time_call(fixed_counts)


def test_make_graphed_capturing_on_the_callers_example_is_refused():
    def make_graphed(fn, example_x):  # no copy: every run(x) overwrites the caller's example_x
        fn(example_x)
        g = CUDAGraph()
        with graph(g):
            static_out = fn(example_x)

        def run(x):
            if x.shape != example_x.shape or x.dtype != example_x.dtype:
                raise ValueError("new shape or dtype")
            example_x.copy_(x)
            g.replay()
            return static_out.clone()
        return run
    with pytest.raises(CheckFailure, match="overwrote example_x.*example_x.clone"):
        check_graphed(make_graphed)


# --- more usual mistakes, each named ---------------------------------------------------------------

def in_milliseconds(fn, warmup, reps, sync, clock):
    return good(fn, warmup, reps, sync, clock) * 1e-3


def divided_by_all_calls(fn, warmup, reps, sync, clock):
    return good(fn, warmup, reps, sync, clock) * reps / (warmup + reps)


def clock_around_each_call(fn, warmup, reps, sync, clock):
    for _ in range(warmup):
        fn()
    sync()
    total = 0.0
    for _ in range(reps):
        t0 = clock()
        fn()
        total += clock() - t0
    sync()
    clock()
    return total / reps * 1e6


def clock_before_the_warmup(fn, warmup, reps, sync, clock):
    t0 = clock()
    for _ in range(warmup):
        fn()
    sync()
    for _ in range(reps):
        fn()
    sync()
    return (clock() - t0) / reps * 1e6


def divided_by_reps_minus_one(fn, warmup, reps, sync, clock):   # refused before, with no hint
    return good(fn, warmup, reps, sync, clock) * reps / (reps - 1)


def one_warmup_call(fn, warmup, reps, sync, clock):
    return good(fn, 1, reps, sync, clock)   # one warm-up call, whatever warmup says


@pytest.mark.parametrize("wrong, says", [
    (no_final_sync, "before the device finished"),
    (no_warmup, "warm-up"),
    (no_sync_after_warmup, "still queued"),
    (sync_every_call, "inside the timed loop"),
    (own_clock, "clock you were given"),
    (in_seconds, "in seconds"),
    (not_divided, "divide by reps"),
    (off_by_a_bit, "us per call"),
    (in_milliseconds, "right time in milliseconds"),
    (divided_by_all_calls, "divided by warmup . reps"),
    (clock_around_each_call, "clock inside the timed loop"),
    (clock_before_the_warmup, "before you started the clock"),
    (one_warmup_call, "should call it warmup . reps"),
    (divided_by_reps_minus_one, "long kernels, short loop.*divided by reps - 1"),
])
def test_time_call_wrong_answers_fail_and_say_why(wrong, says):
    with pytest.raises(CheckFailure, match=says):
        check_time_call(wrong)


def test_time_call_fixed_counts_are_named_when_the_draw_sums_to_110(monkeypatch):
    """warmup + reps drawn as 6 + 104 = 110 (about 1 draw in 120): fixed counts of 10 and 100 call fn
    110 times too, and were named '100 call(s) ran between your two clock readings' instead."""
    import random

    class Draw(random.Random):
        def randint(self, a, b):
            return {(3, 8): 6, (80, 200): 104}.get((a, b)) or super().randint(a, b)
    monkeypatch.setattr(timing.random, "Random", Draw)
    check_time_call(good)
    test_time_call_with_the_default_counts_fixed_is_named()


def _graphed_variant(run_body):
    def make(fn, example_x):
        static_x = example_x.clone()
        fn(static_x)
        g = CUDAGraph()
        with graph(g):
            static_out = fn(static_x)
        return lambda x: run_body(x, static_x, g, static_out)
    return make


def _replay_then_copy(x, static_x, g, static_out):
    if x.shape != static_x.shape or x.dtype != static_x.dtype:
        raise ValueError("new shape")
    g.replay()
    static_x.copy_(x)
    return static_out.clone()


def _assert_shape(x, static_x, g, static_out):
    assert x.shape == static_x.shape and x.dtype == static_x.dtype
    static_x.copy_(x)
    g.replay()
    return static_out.clone()


def _result_into_x(x, static_x, g, static_out):
    if x.shape != static_x.shape or x.dtype != static_x.dtype:
        raise ValueError("new shape")
    static_x.copy_(x)
    g.replay()
    return x.copy_(static_out)


def _recapture_each_call(fn, example_x):
    def run(x):
        if x.shape != example_x.shape or x.dtype != example_x.dtype:
            raise ValueError("new shape")
        static_x, g = x.clone(), CUDAGraph()
        with graph(g):
            out = fn(static_x)
        g.replay()
        return out.clone()
    return run


@pytest.mark.parametrize("wrong, says", [
    (_graphed_variant(_replay_then_copy), "result for the example input"),
    (_graphed_variant(_assert_shape), "must raise ValueError.*AssertionError"),
    (_graphed_variant(_result_into_x), "run.x. changed x"),
    (_recapture_each_call, "one by one"),
])
def test_make_graphed_more_wrong_answers_fail_and_say_why(wrong, says):
    with pytest.raises(CheckFailure, match=says):
        check_graphed(wrong)
