"""Checkers of chapter 1 (launch overhead): timing a call correctly, and a graphed chain of ops.

Both run the same way on a CPU and on a GPU, and print the same verdict:

- :func:`check_time_call` gives the student's timer a pretend device (:class:`FakeDevice`) whose
  work is queued asynchronously and finishes only when waited for, with a pretend host clock, so
  a timer that skips the warm-up, a synchronization, or synchronizes inside its loop reads a
  measurably wrong time, and the message says which step is missing.
- :func:`check_graphed` captures a chain of small ops with the student's ``make_graphed`` (with
  ``torch.cuda.CUDAGraph`` on a GPU, :class:`course_utils.kernels.launch.SimulatedGraph` on the CPU)
  and checks what a graph's rules demand: replay equals eager, new inputs are copied into the
  captured buffer, the returned tensor is not overwritten by the next replay, and a new shape is
  refused.
"""

from __future__ import annotations

import math
import random

import torch

from .. import check, env
from ..check import CheckFailure, require, verdict
from ..kernels.launch import chain_ref
from ..profile import count_launches


class FakeDevice:
    """A pretend GPU with a pretend host clock, with costs the checker chooses (microseconds).

    ``fn()`` spends ``launch_us`` of host time to launch and queues ``work_us`` of device work; the
    very first call also spends ``compile_us`` on the host (compilation, lazy initialization).
    ``sync()`` makes the host wait until the queue is empty. ``clock()`` reads the host clock in
    seconds, like ``time.perf_counter``. ``trace`` lists what was called, in order.
    """

    def __init__(self, launch_us: float, work_us: float, compile_us: float):
        self.launch_us, self.work_us, self.compile_us = launch_us, work_us, compile_us
        self.host_us = 0.0
        self.device_free_us = 0.0
        self.calls = 0
        self.trace: list[str] = []

    def fn(self) -> None:
        if self.calls == 0:
            self.host_us += self.compile_us
        self.host_us += self.launch_us
        start = max(self.host_us, self.device_free_us)
        self.device_free_us = start + self.work_us
        self.calls += 1
        self.trace.append("call")

    def sync(self) -> None:
        self.host_us = max(self.host_us, self.device_free_us)
        self.trace.append("sync")

    def clock(self) -> float:
        self.trace.append("clock")
        return self.host_us * 1e-6


def reference_time_call(fn, warmup: int = 10, reps: int = 100, sync=None, clock=None) -> float:
    """Microseconds per call of ``fn()`` back to back: warm up, sync, clock, reps calls, sync, clock."""
    import time

    sync = sync or (torch.cuda.synchronize if env.on_gpu() else (lambda: None))
    clock = clock or time.perf_counter
    for _ in range(warmup):
        fn()
    sync()
    t0 = clock()
    for _ in range(reps):
        fn()
    sync()
    return (clock() - t0) / reps * 1e6


def _diagnose(trace: list[str], warmup: int, reps: int) -> str | None:
    """What the student's protocol got wrong, read from the order of calls; None if nothing."""
    clocks = [i for i, t in enumerate(trace) if t == "clock"]
    calls = [i for i, t in enumerate(trace) if t == "call"]
    if len(clocks) < 2:
        return (f"your timer read the clock you were given {len(clocks)} time(s); read it once before "
                "the timed calls and once after (use the clock argument, not time.perf_counter: the "
                "checker's clock is the only one that sees its pretend device)")
    c0, c1 = clocks[0], clocks[-1]
    before = [i for i in calls if i < c0]
    timed = [i for i in calls if c0 < i < c1]
    # 10 calls before the clock and 100 between its readings are the defaults, whatever the total: a warmup + reps
    # drawn to sum to 110 (6 + 104) must not turn a timer with fixed counts into "100 calls timed, expected 104"
    fixed = (len(before), len(timed)) == (10, 100) and (warmup, reps) != (10, 100)
    if len(calls) != warmup + reps or fixed:
        defaults = (" (10 + 100, the defaults: loop over the warmup and reps you were given, not fixed "
                    "numbers)") if (len(before), len(timed)) == (10, 100) else ""
        return (f"your timer called fn {len(calls)} times{defaults}; with warmup={warmup} and reps={reps} it "
                f"should call it warmup + reps = {warmup + reps} times")
    if len(before) < warmup:
        return (f"only {len(before)} call(s) ran before you started the clock, expected the {warmup} "
                "warm-up calls: the first call compiles and initializes, and must not be timed")
    if len(timed) != reps:
        return f"{len(timed)} call(s) ran between your two clock readings, expected reps = {reps}"
    if before and "sync" not in trace[before[-1]:c0]:
        return ("you started the clock while the warm-up's work was still queued on the device: "
                "call sync() after the warm-up and before the first clock()")
    if "sync" not in trace[timed[-1]:c1]:
        return ("you read the clock before the device finished: launches return at once, so call "
                "sync() after the timed calls and before the second clock()")
    if "sync" in trace[timed[0]:timed[-1]]:
        return ("you synchronized inside the timed loop: each call then waits for the previous one, "
                "so you measure launch + work one after the other instead of calls back to back; "
                "sync once after the loop")
    if "clock" in trace[timed[0]:timed[-1]]:
        return ("you read the clock inside the timed loop: a launch returns before its work is done, so the "
                "time around one call is its launch alone; read the clock once before the loop and once "
                "after the final sync")
    return None


def check_time_call(time_call) -> None:
    """Judge ``time_call(fn, warmup=, reps=, sync=, clock=) -> microseconds per call``."""
    if not callable(time_call):
        raise CheckFailure(f"time_call must be a function, got {type(time_call).__name__}")
    check.refuse_answer_key("time_call", time_call, {"reference timer (checkers.timing.reference_time_call)":
                                                     reference_time_call})
    rng = random.Random()
    scenarios = [
        # (what it shows, launch_us, work_us, compile_us, warmup, reps)
        ("device-bound calls", rng.uniform(4, 8), rng.uniform(40, 80), rng.uniform(2e4, 8e4),
         rng.randint(3, 8), rng.randint(80, 200)),
        ("long kernels, short loop", rng.uniform(4, 8), rng.uniform(300, 600), rng.uniform(2e4, 8e4),
         rng.randint(8, 12), rng.randint(15, 25)),
        ("launch-bound calls", rng.uniform(6, 12), rng.uniform(1, 3), rng.uniform(2e4, 8e4),
         rng.randint(3, 8), rng.randint(80, 200)),
    ]
    for what, launch, work, compile_us, warmup, reps in scenarios:
        case = (f"time_call on a pretend device ({what}: launch {launch:.1f} us, work {work:.1f} us, "
                f"warmup={warmup}, reps={reps})")
        dev = FakeDevice(launch, work, compile_us)
        try:
            got = time_call(dev.fn, warmup=warmup, reps=reps, sync=dev.sync, clock=dev.clock)
        except NotImplementedError:
            raise
        except CheckFailure:
            raise
        except Exception as e:
            raise CheckFailure(f"{case}: your function raised {type(e).__name__}: {e}") from e
        ref_dev = FakeDevice(launch, work, compile_us)
        expected = reference_time_call(ref_dev.fn, warmup, reps, ref_dev.sync, ref_dev.clock)
        problem = _diagnose(dev.trace, warmup, reps)
        if problem:
            raise CheckFailure(f"{case}: {problem}.")
        if not isinstance(got, (int, float)) or isinstance(got, bool) or not math.isfinite(got):
            raise CheckFailure(f"{case}: expected a finite number of microseconds per call, got {got!r}")
        if abs(got - expected) > 0.02 * expected:
            hint = ""
            for unit, factor in (("seconds", 1e-6), ("milliseconds", 1e-3), ("nanoseconds", 1e3)):
                if abs(got - expected * factor) <= 0.02 * expected * factor:
                    hint = f" That is the right time in {unit}: return microseconds (multiply accordingly)."
            if not hint and abs(got - expected * reps) <= 0.02 * expected * reps:
                hint = " That is the time of all reps together: divide by reps."
            if not hint and abs(got - expected * reps / (reps - 1)) <= 0.002 * expected:
                # off by 1/(reps - 1): within the 2% tolerance at 80 reps or more, named where the loop is short
                hint = (" That is the timed calls' time divided by reps - 1: reps calls ran between the clock "
                        "readings, so divide by reps.")
            if not hint and abs(got - expected * reps / (warmup + reps)) <= 0.02 * expected:
                hint = (" That is the timed calls' time divided by warmup + reps: only the reps calls ran "
                        "between the clock readings, so divide by reps.")
            raise CheckFailure(f"{case}: you returned {got:.4g} us per call, the pretend device took "
                               f"{expected:.4g} us per call.{hint}")
    verdict("time_call", "warm-up, synchronization and per-call time right on 3 pretend devices "
                         "(device-bound, long kernels, launch-bound)")


def _fresh(shape, dtype=torch.float32):
    return check.randn(shape, dtype)


def check_graphed(make_graphed) -> None:
    """Judge ``make_graphed(fn, example_x) -> run(x)`` on a chain of small ops.

    ``run(x)`` must copy ``x`` into the captured input, replay, and return a tensor the next replay
    does not overwrite; a shape other than the example's must raise ``ValueError``.
    """
    if not callable(make_graphed):
        raise CheckFailure(f"make_graphed must be a function, got {type(make_graphed).__name__}")
    from .. import graphs
    check.refuse_answer_key("make_graphed", make_graphed, {"graph helper (course_utils.graphs.capture)":
                                                           graphs.capture})
    rng = random.Random()
    rows, cols = rng.choice([3, 5, 7]), rng.choice([33, 65, 127])
    n_ops = rng.randint(3, 8)

    def fn(x):
        return chain_ref(x, n_ops)

    name = f"make_graphed (a chain of {n_ops} small ops on a {rows}x{cols} float32 tensor)"
    example = _fresh((rows, cols))
    example_before = example.clone()
    try:
        run = make_graphed(fn, example)
    except NotImplementedError:
        raise
    except Exception as e:
        raise CheckFailure(f"{name}: make_graphed raised {type(e).__name__}: {e}") from e
    require(callable(run), f"{name}: make_graphed must return a function run(x), got {type(run).__name__}")

    def call(x, what):
        try:
            return run(x)
        except NotImplementedError:
            raise
        except Exception as e:
            raise CheckFailure(f"{name}: run({what}) raised {type(e).__name__}: {e}") from e

    x1, x2 = _fresh((rows, cols)), _fresh((rows, cols))
    x1_before = x1.clone()
    r1 = call(x1, "x")
    require(isinstance(r1, torch.Tensor), f"{name}: run(x) must return a tensor, got {type(r1).__name__}")
    require(torch.equal(x1, x1_before), f"{name}: run(x) changed x; it must only read it (copy x into the "
            "captured input, and return a copy of the captured output, not x overwritten)")
    want1, want_example = fn(x1_before), fn(example_before)
    if tuple(r1.shape) == tuple(want1.shape):
        if bool(r1.isnan().all()):
            raise CheckFailure(f"{name}: run(x) returned the output as capture left it (garbage, NaN "
                               "here): call g.replay() before you read the output")
        if not torch.allclose(r1, want1, atol=1e-5, rtol=1e-5) and \
                torch.allclose(r1, want_example, atol=1e-5, rtol=1e-5):
            raise CheckFailure(f"{name}: run(x) returned the result for the example input, not for x: "
                               "replay reads the tensor captured as input, so copy the new values into "
                               "it (static_x.copy_(x)) before g.replay()")
    check.compare(f"{name}: run(x) against eager fn(x)", r1, want1,
                  hint="copy x into the captured input, replay, return the captured output")
    require(torch.equal(example, example_before), f"{name}: run(x) overwrote example_x, the caller's tensor: "
            "capture on your own copy (static_x = example_x.clone()) and copy each new x into that copy")
    r2 = call(x2, "a second x")
    check.compare(f"{name}: a second run(x) against eager fn(x)", r2, fn(x2),
                  hint="every call must copy its x into the captured input before replaying")
    if not torch.allclose(r1, want1, atol=1e-5, rtol=1e-5):
        raise CheckFailure(f"{name}: the tensor the first run(x) returned changed when run was called "
                           "again: every replay writes into the same output tensor, so return a copy "
                           "(static_out.clone())")
    counts = count_launches(run, x2)
    chain_ops = sum(n for op, n in counts.torch.items() if op in ("add", "mul"))
    if chain_ops:
        raise CheckFailure(f"{name}: run(x) launched the chain's ops one by one ({counts}): capture fn "
                           "once in make_graphed, and in run only copy x in, replay, and copy out")
    # Each of these would be silently broadcast or cast by static_x.copy_(x): checking len(x) only
    # (or the shape without the dtype) lets them through.
    wrong = [(_fresh((1, cols)), f"x of shape {(1, cols)}"), (_fresh((rows, 1)), f"x of shape {(rows, 1)} "
             "(same len(x): checking len(x) is not enough)"),
             (_fresh((rows, cols), torch.float64), "x of dtype float64 (copy_ would cast it silently)")]
    for bad, what in wrong:
        try:
            call(bad, what)
        except CheckFailure as e:
            if isinstance(e.__cause__, ValueError):
                continue
            raise CheckFailure(f"{name}: run({what}) must raise ValueError (the graph was captured for "
                               f"{(rows, cols)} float32), it raised {type(e.__cause__).__name__}: {e.__cause__}") from e
        raise CheckFailure(f"{name}: run() accepted {what}, but the graph replays the shape and dtype it "
                           f"captured, {(rows, cols)} float32: compare x.shape and x.dtype with the captured "
                           "input's and raise ValueError; a new shape or dtype needs a new capture")
    verdict("make_graphed", "one replay instead of one launch per op, matches eager on fresh inputs, "
                            "copies new inputs in, returns outputs the next replay cannot overwrite, "
                            "refuses a new shape")
