"""Checkers of chapter 8 (benchmarking): a student's timer, bandwidth probe and roofline, judged on
a :class:`course_utils.bench.SimulatedGPU` whose behaviour the checker controls.

Every call builds fresh simulated GPUs with random bandwidths, L2 sizes, launch overheads and
compile times, so only a benchmark that follows the protocol (warm up, synchronize, time on the
device, flush L2 or use a working set of at least 4x L2, take the median) lands within tolerance
of the true kernel time. The simulated GPUs are sealed (:class:`SealedGPU`): the student's code
cannot read their bandwidth or true kernel time, and the course's answers (``bench.time_ms`` in
8.1, ``bench.attainable_tflops``) are refused under any name. A passing check prints one
deterministic line; a failing one raises :class:`course_utils.check.CheckFailure` saying which rule
the numbers point to.
"""

from __future__ import annotations

import math
import os
import random
import sys

from .. import bench
from ..check import CheckFailure, refuse_answer_key, verdict
from ..faults import bench as faults

TIMER_TOLERANCE = 0.05      # relative error allowed on a kernel's time
BANDWIDTH_TOLERANCE = 0.05  # relative error allowed on a measured bandwidth
UNITS_TOLERANCE = 0.03      # ... and on it against the bytes over the time of the kernels it called


def _rng() -> random.Random:
    return random.Random(int.from_bytes(os.urandom(8), "little"))


SEALED = {"hbm_gbps": "its DRAM bandwidth", "l2_gbps": "its L2 bandwidth", "latency_us": "its kernel latency",
          "jit_ms": "its compile time", "true_ms": "the true kernel time", "_queue_end": "its queue",
          "_host": "its host clock", "_rng": "its noise", "_ran": "its kernels' durations",
          "poison": "the checker's probe of the first call", "first_end": "the checker's probe of the first call",
          "timed": "the checker's probe of the first call"}


class SealedGPU(bench.SimulatedGPU):
    """A simulated GPU whose answers (bandwidth, true time...) only the course's own code can read.

    The student gets the interface a real GPU has: kernels, events, synchronize, flush_l2, l2_bytes,
    a host clock. Reading ``gpu.hbm_gbps`` or calling ``gpu.true_ms(k)`` is reading the answer.
    A trace records the order of kernel calls and event records (a timed first call: no warm-up).
    """

    def __getattribute__(self, name):
        if name in SEALED and not sys._getframe(1).f_globals.get("__name__", "").startswith("course_utils"):
            raise CheckFailure(f"your code read gpu.{name}, {SEALED[name]}: that is what the exercise asks you "
                               "to measure. Use only kernels, events, synchronize, flush_l2, l2_bytes and host_time.")
        return object.__getattribute__(self, name)

    def kernel(self, nbytes: int, name: str = ""):
        k = super().kernel(nbytes, name)
        gpu = self
        original = type(k).__call__

        class Traced(type(k)):
            def __call__(self):
                gpu._note_harness()
                gpu.trace.append("call")
                out = original(self)
                if self is gpu.timed and gpu.first_end is None and gpu._capturing is None:
                    gpu.first_end = gpu._queue_end  # the first call (it compiles) ends here on the device
                return out
        k.__class__ = Traced
        return k

    def flush_l2(self) -> None:
        self.trace.append("flush")
        super().flush_l2()

    def synchronize(self) -> None:
        self.trace.append("sync")
        super().synchronize()

    def graph(self, fn):
        before = self.trace.count("call")
        replay = super().graph(fn)
        self.graph_calls = max(self.graph_calls, self.trace.count("call") - before)  # calls in one replay
        return replay

    def Event(self, enable_timing: bool = True):  # noqa: N802  (mirrors torch.cuda.Event)
        self._note_harness()
        e = super().Event(enable_timing)
        gpu, record, elapsed = self, type(e).record, type(e).elapsed_time

        class Traced(type(e)):
            def record(self):
                gpu.trace.append("record")
                return record(self)

            def elapsed_time(self, end):
                ms = elapsed(self, end)
                if gpu.poison and gpu.first_end is not None and self.t < gpu.first_end <= end.t:
                    # this pair timed the first call: make it far slower, or half a warm call (not
                    # absurdly small: a timer may size its loops from it)
                    return ms + 1e4 if gpu.poison == "slow" else 0.5 * gpu.true_ms(gpu.timed)
                return ms
        e.__class__ = Traced
        return e

    def _note_harness(self) -> None:
        """Under check_timer, note (and refuse) the course's harness driving this GPU, whatever name
        it was reached by: its code is on the call stack."""
        if not self.refuse_harness:
            return
        f = sys._getframe(2)
        while f is not None:
            module = f.f_globals.get("__name__", "")
            if module in HARNESS_MODULES:
                self.harness = f"{module}.{f.f_code.co_name}"
                raise CheckFailure(_harness_message(self.harness))
            f = f.f_back


HARNESS_MODULES = ("course_utils.timing", "course_utils.sweeps", "triton.testing")


def _harness_message(where: str) -> str:
    return (f"exercise 8.1 asks you to write the protocol yourself, but the course's harness ({where}) "
            "called your kernel: whatever name it was reached by (bench.time_ms, bench.time_rounds, "
            "timing.time_ms...), it is the answer. Write the warm-up, events, flush and median yourself.")


def gpu_params(rng: random.Random | None = None, **overrides) -> dict:
    """Random (plausible) parameters of a simulated GPU; ``overrides`` fixes some of them. The noise (2.5%)
    puts the minimum of the repetitions outside the timer's tolerance, and leaves their median inside it."""
    rng = rng or _rng()
    hbm = rng.uniform(800, 4500)
    params = dict(hbm_gbps=hbm, l2_gbps=hbm * rng.uniform(2.5, 4),
                  l2_bytes=rng.choice([4, 6, 40, 50, 60]) * 2**20,
                  launch_us=rng.uniform(4, 15), latency_us=rng.uniform(0.5, 1.5), jit_ms=rng.uniform(30, 400),
                  noise=0.025, spike_prob=0.15, spike=rng.uniform(2.5, 4), sync_us=rng.uniform(3, 10),
                  seed=rng.randrange(2**31))
    params.update(overrides)
    return params


def sealed_gpu(params: dict, poison: str | None = None, refuse_harness: bool = False) -> SealedGPU:
    """A :class:`SealedGPU` with ``params``; ``poison`` ("slow"/"fast") rewrites the elapsed time of
    any event pair around the first call of the kernel under test (``gpu.timed``): 10 s longer, or half
    the kernel's true time."""
    gpu = SealedGPU(**params)
    gpu.trace, gpu.timed, gpu.first_end, gpu.poison = [], None, None, poison
    gpu.refuse_harness, gpu.harness, gpu.graph_calls = refuse_harness, None, 0
    return gpu


def random_gpu(rng: random.Random | None = None, **overrides) -> bench.SimulatedGPU:
    """A simulated GPU with random (plausible) parameters; ``overrides`` fixes some of them."""
    return sealed_gpu(gpu_params(rng, **overrides))


def _number(what: str, got) -> float:
    if got is None:
        raise CheckFailure(f"{what}: your function returned nothing; return a number")
    if isinstance(got, bench.Timing):
        got = got.median
    try:
        value = float(got)
    except (TypeError, ValueError):
        raise CheckFailure(f"{what}: expected a number, got {type(got).__name__}") from None
    if not math.isfinite(value) or value <= 0:
        raise CheckFailure(f"{what}: expected a positive finite number, got {value!r}")
    return value


def _run_timer(time_kernel, gpu, kernel, what: str) -> float:
    try:
        got = time_kernel(gpu, kernel)
    except NotImplementedError:
        raise
    except Exception as e:  # the harness may have wrapped the refusal in its own error
        if gpu.harness:
            raise CheckFailure(f"{what}: {_harness_message(gpu.harness)}") from None
        if isinstance(e, CheckFailure):
            raise
        raise CheckFailure(f"{what}: your function raised {type(e).__name__}: {e}") from e
    if gpu.harness:
        raise CheckFailure(f"{what}: {_harness_message(gpu.harness)}")
    if isinstance(got, (int, float)) and not isinstance(got, bool) and got <= 0 and gpu.events:
        fault = "zero" if got == 0 else "negative"
        raise CheckFailure(f"{what}: you returned {got!r}: {fault}: {faults.TIMER_FAULTS[fault]}.")
    if isinstance(got, (list, tuple)):
        raise CheckFailure(f"{what}: expected a number, got a {type(got).__name__} of {len(got)}: return one "
                           "number, the median of your repetitions' times in milliseconds")
    return _number(what, got)


def check_timer(time_kernel, n_gpus: int = 4) -> None:
    """Exercise 8.1: ``time_kernel(gpu, fn) -> ms`` must report the kernel's own (cold-L2) time.

    Judged by behaviour: each case runs twice on twin GPUs (same parameters and noise) that differ
    only in what an event pair around the kernel's first call (its compilation) reports, far slower
    on one twin and half a warm call on the other. A timer that excludes the first call, by warming
    up before its events or by discarding the first repetitions, returns the same number on both; one
    that lets it into its statistic (even a median) does not. A timer whose calls depend on that
    pair (it sizes its warm-up or repetitions from it: the twins' traces differ, and so does the
    noise each call draws) is judged on each twin's number against the true time instead. The
    course's harness driving the GPU is refused whatever name reached it (its code is on the call
    stack when the kernel is called).
    """
    if not callable(time_kernel):
        raise CheckFailure(f"time_kernel must be a function, got {type(time_kernel).__name__}")
    from .. import timing
    refuse_answer_key("time_kernel", time_kernel, {"benchmark harness (bench.time_ms), which exercise 8.1 asks "
                                                   "you to write yourself": timing.time_ms,
                                                   "benchmark harness (bench.time_rounds)": timing.time_rounds})
    rng = _rng()
    for i in range(n_gpus):
        for small in (False, True):
            params = gpu_params(rng)
            # a large working set (> 4x L2) or a small one that fits in L2 with room to spare
            nbytes = int(params["l2_bytes"] * (rng.uniform(4, 8) if not small else rng.uniform(0.2, 0.5)))
            what = f"time_kernel on simulated GPU {i + 1} ({'small' if small else 'large'} working set)"
            got, twins = {}, {}
            for poison in ("slow", "fast"):
                gpu = sealed_gpu(params, poison=poison, refuse_harness=True)
                gpu.timed = kernel = gpu.kernel(nbytes, "copy")
                got[poison] = _run_timer(time_kernel, gpu, kernel, what)
                twins[poison] = (gpu, kernel)
            same_calls = twins["slow"][0].trace == twins["fast"][0].trace
            if same_calls and got["slow"] != got["fast"]:
                raise CheckFailure(f"{what}: no warm-up: the number you return depends on how long the first "
                                   f"call of fn took ({got['slow']:.4g} ms when it was slow, {got['fast']:.4g} ms "
                                   "when it was fast; it compiles, so it is slow on a real GPU). Call fn() a few "
                                   "times and gpu.synchronize() before the events you keep, or discard the "
                                   "repetitions that include the first call (a median only hides it).")
            for poison in ("slow",) if same_calls else ("slow", "fast"):
                gpu, kernel = twins[poison]
                true = gpu.true_ms(kernel)
                ratio = got[poison] / true
                if abs(ratio - 1) > TIMER_TOLERANCE:
                    raise CheckFailure(
                        f"{what}: you reported {got[poison]:.4g} ms for a kernel that takes {true:.4g} ms "
                        f"({ratio:.2f}x). " + " ".join(faults.timer_hints(gpu, kernel, got[poison], true, small)))
    verdict("time_kernel", f"within {TIMER_TOLERANCE:.0%} of the true kernel time on {2 * n_gpus} simulated "
            "GPUs (warm-up, sync, events, L2 flush, median)")


def check_bandwidth(copy_bandwidth, n_gpus: int = 4) -> None:
    """Exercise 8.2: ``copy_bandwidth(gpu) -> GB/s`` must find the GPU's DRAM bandwidth."""
    if not callable(copy_bandwidth):
        raise CheckFailure(f"copy_bandwidth must be a function, got {type(copy_bandwidth).__name__}")
    rng = _rng()
    for i in range(n_gpus):
        # data-center L2 sizes: there, 4x L2 is enough for the fixed start-up cost to fade out. The first
        # GPU launches fast (1-2 us, as from a graph or C++), so an L2-resident working set timed without a
        # flush runs at L2 speed there instead of hiding behind the launch: the max of a sweep is caught
        fast_host = {"launch_us": rng.uniform(1.0, 2.0)} if i == 0 else {}
        gpu = random_gpu(rng, l2_bytes=rng.choice([40, 50, 60]) * 2**20, latency_us=rng.uniform(0.3, 1.0),
                         noise=0.01, **fast_host)
        what = f"copy_bandwidth on simulated GPU {i + 1}"
        try:
            got = copy_bandwidth(gpu)
        except (NotImplementedError, CheckFailure):
            raise
        except Exception as e:
            raise CheckFailure(f"{what}: your function raised {type(e).__name__}: {e}") from e
        if isinstance(got, bench.Timing):
            raise CheckFailure(f"{what}: returned a Timing: {faults.BANDWIDTH_FAULTS['returned a Timing']}.")
        got = _number(what, got)
        ratio = got / gpu.hbm_gbps
        if not gpu.kernels:
            raise CheckFailure(f"{what}: you never made a kernel, so nothing was measured: make one with "
                               "gpu.kernel(nbytes) and time it")
        biggest = max((k.nbytes for k in gpu.kernels), default=0)
        named = faults.bandwidth_fault(gpu, got, ratio, 4 * gpu.l2_bytes)
        if abs(ratio - 1) <= BANDWIDTH_TOLERANCE:
            if biggest < 4 * gpu.l2_bytes:
                raise CheckFailure(f"{what}: close, but your largest working set ({biggest} bytes) is "
                                   f"under 4x L2 ({4 * gpu.l2_bytes} bytes): a bandwidth claim needs one "
                                   "that large")
            slip = faults.bandwidth_slip(gpu, got, UNITS_TOLERANCE)
            if slip is not None:
                raise CheckFailure(f"{what}: you measured {got:.4g} GB/s, {slip:.3f}x of what your kernel's bytes "
                                   "over its time give. " + (named or "Count nbytes once and convert units by "
                                                             "powers of ten: GB/s = nbytes / (ms * 1e-3) / 1e9."))
            continue
        msg = (f"{what}: you measured {got:.4g} GB/s on a GPU whose DRAM moves {gpu.hbm_gbps:.4g} GB/s "
               f"({ratio:.2f}x).")
        if named and "never called" in named:
            msg += " " + named
        elif biggest < 4 * gpu.l2_bytes:
            msg += (f" Your working set ({biggest} bytes) is under 4x the L2 "
                    f"(gpu.l2_bytes = {gpu.l2_bytes}): "
                    + ("it ran from L2, faster than DRAM." if ratio > 1 else
                       "a small kernel is dominated by its fixed start-up latency."))
        elif named:
            msg += " " + named
        elif ratio > 1:
            msg += " Count the bytes the kernel moved once (nbytes), and time in milliseconds."
        else:
            msg += (" Time the kernel by the protocol (cu.bench.time_ms(fn, device=gpu)), divide nbytes by its "
                    "median (not its mean) in seconds, and count GB as 1e9 bytes.")
        raise CheckFailure(msg)
    verdict("copy_bandwidth", f"within {BANDWIDTH_TOLERANCE:.0%} of the DRAM bandwidth on {n_gpus} "
            "simulated GPUs, working set >= 4x L2")


def check_attainable(attainable) -> None:
    """Exercise 8.3: ``attainable(intensity, peak_tflops, bw_gbps) -> TFLOP/s`` (the roofline).

    The course's roofline (:mod:`course_utils.ceilings`: ``attainable_tflops``, ``ridge_point``,
    ``roofline_seconds``, ``Ceilings``) is refused by name and, reached by any name, when it runs."""
    if not callable(attainable):
        raise CheckFailure(f"attainable must be a function, got {type(attainable).__name__}")
    refuse_answer_key("attainable", attainable, {"roofline (bench.attainable_tflops)": bench.attainable_tflops,
                                                 "roofline (bench.roofline_seconds)": bench.roofline_seconds,
                                                 "ridge point (bench.ridge_point)": bench.ridge_point,
                                                 "ceilings and their roofline (bench.Ceilings)": bench.Ceilings})
    rng = _rng()
    cases = []
    for _ in range(20):
        peak, bw = rng.uniform(10, 1000), rng.uniform(300, 5000)
        ridge = peak * 1e3 / bw
        cases += [(rng.uniform(0.01, ridge), peak, bw), (rng.uniform(ridge, 50 * ridge), peak, bw)]
    cases = [(0.1, 100.0, 500.0), (1000.0, 100.0, 500.0)] + cases  # tell min/max and unit slips apart
    cases += [(0.0, 989.0, 3350.0), (989e3 / 3350, 989.0, 3350.0), (1e6, 100.0, 1000.0)]
    for intensity, peak, bw in cases:
        what = f"attainable(intensity={intensity:.4g}, peak_tflops={peak:.4g}, bw_gbps={bw:.4g})"
        expected = bench.attainable_tflops(intensity, peak, bw)
        try:
            got, where = faults.run_watched(attainable, (intensity, peak, bw))
        except (NotImplementedError, CheckFailure):
            raise
        except Exception as e:
            raise CheckFailure(f"{what}: your function raised {type(e).__name__}: {e}") from e
        if where:
            raise CheckFailure(f"{what}: course roofline: {faults.ROOF_FAULTS['course roofline'].format(where=where)}.")
        if got is None:
            raise CheckFailure(f"{what}: your function returned nothing")
        if isinstance(got, (str, bytes, bool)):
            raise CheckFailure(f"{what}: expected a number (TFLOP/s), got {type(got).__name__} {got!r}")
        try:
            got = float(got)
        except (TypeError, ValueError):
            raise CheckFailure(f"{what}: expected a number (TFLOP/s), got {type(got).__name__}: return the "
                               "attainable TFLOP/s alone") from None
        if not math.isclose(got, expected, rel_tol=1e-6, abs_tol=1e-9):
            hint = faults.roof_fault(attainable, (intensity, peak, bw), got, expected)
            raise CheckFailure(f"{what}: got {got:.6g} TFLOP/s, expected {expected:.6g}.{hint}")
    verdict("attainable", "matches the roofline min(peak, intensity x bandwidth) on both sides of the ridge")
