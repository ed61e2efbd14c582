"""Naming the fault behind a wrong answer to chapter 8's exercises. Not a checker: it refuses nothing;
:mod:`course_utils.checkers.bench` refuses the course's answers first and asks here what a wrong answer did.

A timer's fault is read from what it did on the simulated GPU: the trace of its kernel calls, event records,
flushes and synchronizations (split at the records: a stretch between two records that holds a call is a
timed repetition), and how far its number is from the true time. A bandwidth's fault is read from its
ratio to what the kernels it called give (their bytes over their time); a roofline's from a few probes
compared with the usual slips (min and max, the units, FLOPs and bytes swapped). The texts are in
:mod:`course_utils.checker_texts.bench`.
"""

from __future__ import annotations

import math
import statistics

from ..checker_texts.bench import BANDWIDTH_FAULTS, ROOF_FAULTS, TIMER_FAULTS
from ..checkers.calls import run_with_hook


def _named(table: dict, fault: str, **kw) -> str:
    return f"{fault}: {table[fault].format(**kw)}."


def _segments(trace: list) -> list[list]:
    """The trace split at each event record: [before the first record, between records..., after the last]."""
    segs = [[]]
    for token in trace:
        if token == "record":
            segs.append([])
        else:
            segs[-1].append(token)
    return segs


def _most(count: int, of: int) -> bool:
    return of > 0 and 2 * count > of


def timer_fault(gpu, kernel, got: float, true: float, small: bool) -> str | None:
    """The named fault of a timer that reported ``got`` ms for a kernel of ``true`` ms, or None."""
    ratio = got / true
    if kernel.calls == 0:
        return _named(TIMER_FAULTS, "fn never called")
    if gpu.events == 0 and gpu.host_reads == 0:
        return _named(TIMER_FAULTS, "no clock read")
    if gpu.syncs == 0:
        return None  # the no-synchronize hint says it (a host clock that never waited can land anywhere, 1000x too)
    if 0.7e-3 < ratio < 1.4e-3:
        return _named(TIMER_FAULTS, "seconds")
    if 0.7e3 < ratio < 1.4e3:
        return _named(TIMER_FAULTS, "microseconds")
    if gpu.events == 0:
        return None  # the host-clock hint says it
    segs = _segments(gpu.trace)
    inner = range(1, len(segs) - 1)
    timed = [i for i in inner if "call" in segs[i]]
    many = [segs[i] for i in timed if segs[i].count("call") >= 2 and "sync" not in segs[i]]
    if many:
        calls = max(s.count("call") for s in many)
        if ratio >= 0.5 * calls:
            return _named(TIMER_FAULTS, "not divided by the calls", calls=calls)
        flushes = max(s.count("flush") for s in many)
        return _named(TIMER_FAULTS, "many calls in one pair", calls=calls,
                      flushes=f" and {flushes} flushes" if flushes else "")
    reps = len(timed)
    if reps >= 5 and 0.5 * reps <= ratio <= 3 * reps:
        return _named(TIMER_FAULTS, "sum of the repetitions", reps=reps)
    if _most(sum("flush" in segs[i] and segs[i].index("flush") < segs[i].index("call") for i in timed), reps):
        return _named(TIMER_FAULTS, "flush inside the events")
    if _most(sum("sync" in segs[i][segs[i].index("call"):] for i in timed), reps):
        return _named(TIMER_FAULTS, "synchronize inside the events")
    if _most(sum(bool(segs[i - 1]) and segs[i - 1][-1] == "sync" for i in timed), reps):
        return _named(TIMER_FAULTS, "synchronize before the start event")
    flushes = sum(segs[i - 1].count("flush") > 0 for i in timed)
    # a working set larger than L2 is never warm, but an unflushed repetition of a kernel shorter than its launch
    # waits for that launch inside its events (too slow): flushed once, 6 of 300 checks got a ratio near 2 there
    if flushes < reps and (abs(ratio - 1) > 0.05 if small else ratio > 1.05):
        return _named(TIMER_FAULTS, "flush before each repetition", flushes=gpu.flushes, reps=reps,
                      working_set="this kernel's working set fits in L2 and " if small else
                      "this kernel is shorter than its launch and ")
    if ratio < 1 and (flushes >= reps or not small):
        return _named(TIMER_FAULTS, "minimum")
    return None


def timer_hints(gpu, kernel, got: float, true: float, small: bool) -> list[str]:
    """What a timer that reported ``got`` ms for a kernel of ``true`` ms got wrong: its named fault, or hints."""
    named = timer_fault(gpu, kernel, got, true, small)
    if named:
        return [named]
    hints = []
    ratio = got / true
    if gpu.syncs == 0:
        hints.append("you never synchronized: the host clock ran ahead of the GPU, so you timed how fast "
                     "the host fills the queue. Synchronize before reading any clock (events need it too).")
    elif (got - true) * kernel.calls > 0.3 * gpu.jit_ms:
        hints.append("your number includes the compilation of the first call: warm up (call it a few "
                     "times, then synchronize) before timing.")
    elif gpu.host_reads and ratio > 1:
        hints.append("the host clock includes the launch overhead, the synchronization and the flush: "
                     "record gpu.Event() before and after each call and use start.elapsed_time(end).")
    elif small and gpu.flushes == 0 and ratio < 1:
        hints.append("this kernel's working set fits in L2 and you never flushed it between repetitions: "
                     "after the first repetition it ran from L2. Call gpu.flush_l2() before each one.")
    elif gpu.events and gpu.flushes and 1.05 < ratio < 2:
        hints.append("a few repetitions were slowed down (other work on the GPU, clocks): the mean follows "
                     "them, the median does not. Report the median of per-repetition times.")
    if not hints:
        hints.append("follow the protocol: warm up, synchronize, flush L2 before each repetition, events "
                     "around each call, synchronize, then the median of elapsed_time.")
    return hints


def _ran_ms(gpu, k) -> float:
    """The median duration of ``k``'s runs on the simulated GPU (its true time if it never ran): what a right
    protocol's median measures, within the sampling of its own repetitions."""
    ran = gpu._ran.get(id(k))
    return statistics.median(ran) if ran else gpu.true_ms(k)


def bandwidth_fault(gpu, got: float, ratio: float, four_l2: int) -> str | None:
    """The named fault of a bandwidth ``got`` GB/s (``ratio`` to the DRAM's), or None."""
    called = [k for k in gpu.kernels if k.calls]
    if not called:
        return _named(BANDWIDTH_FAULTS, "kernel never called")
    if gpu.syncs == 0:
        return _named(BANDWIDTH_FAULTS, "never synchronized")
    small = [k.nbytes for k in called if k.nbytes < four_l2]
    if ratio > 1 and small:
        return _named(BANDWIDTH_FAULTS, "a small working set made the number", small=min(small))
    if getattr(gpu, "graph_calls", 0) and ratio < 1:
        return _named(BANDWIDTH_FAULTS, "CUDA graph", calls=gpu.graph_calls)
    slips = {"half the bytes": 0.5, "twice the bytes": 2.0, "GiB": 1e9 / 2**30, "MiB": 1e6 / 2**20,
             "milliseconds as seconds": 1e-3, "seconds as milliseconds": 1e3}
    # the nearest slip, not the first within 1.5%: MiB (0.954x) and GiB (0.931x) overlap there, and a MiB answer
    # timed 1.3% slow was named GiB (1 run in 300). Nearest to what the kernel's runs give, not its true time: the
    # median of ten noisy repetitions, some of them spiked, runs up to 1.2% slow, past the middle between MiB and GiB
    # (a MiB answer was still named GiB about once in 10000 GPUs)
    near = [(abs(math.log(got / (k.nbytes / _ran_ms(gpu, k) / 1e6) / factor)), fault)
            for k in called for fault, factor in slips.items()]
    dist, fault = min(near)
    return _named(BANDWIDTH_FAULTS, fault) if dist < math.log(1 / 0.985) else None


def bandwidth_slip(gpu, got: float, tolerance: float) -> float | None:
    """``got`` over the nearest of the DRAM's bandwidth and what each called kernel gives (its bytes over its
    true time), when even the nearest is off by more than ``tolerance`` (a units slip inside the tolerance
    on the DRAM's bandwidth); else None."""
    refs = [gpu.hbm_gbps] + [k.nbytes / gpu.true_ms(k) / 1e6 for k in gpu.kernels if k.calls]
    r = min((got / ref for ref in refs), key=lambda x: abs(math.log(x)))
    return r if abs(r - 1) > tolerance else None


ROOF_MODULES = ("course_utils.ceilings", "course_utils.roofline", "course_utils.traffic", "course_utils.hardware")


def run_watched(fn, args: tuple) -> tuple[object, str | None]:
    """``fn(*args)`` and the first function of the course's roofline modules it ran (None if none)."""
    seen: list[str] = []

    def profile(frame, event, arg):
        if event == "call" and not seen and frame.f_globals.get("__name__") in ROOF_MODULES:
            seen.append(f"{frame.f_globals['__name__']}.{frame.f_code.co_qualname}")
    return run_with_hook(fn, args, profile), (seen[0] if seen else None)


ROOF_SLIPS = {
    "max": lambda i, p, b: max(p, i * b / 1e3),
    "GFLOP/s": lambda i, p, b: min(p, i * b),
    "x1000": lambda i, p, b: min(p, i * b * 1e3),
    "1024": lambda i, p, b: min(p, i * b / 1024),
    "no compute ceiling": lambda i, p, b: i * b / 1e3,
    "no memory roof": lambda i, p, b: p,
    "bytes per FLOP": lambda i, p, b: min(p, b / i / 1e3),
    "FLOP/s": lambda i, p, b: min(p * 1e12, i * b * 1e9),
}
ROOF_PROBES = ((0.1, 100.0, 500.0), (1000.0, 100.0, 500.0), (1e-6, 100.0, 500.0))


def roof_fault(attainable, case: tuple, got: float, expected: float) -> str:
    """The named slip of a roofline that gave ``got`` for ``case`` instead of ``expected``, or ''."""
    try:
        probes = [float(attainable(*c)) for c in ROOF_PROBES]
    except Exception:
        probes = None
    if probes is not None:
        for fault, slip in ROOF_SLIPS.items():
            if all(math.isclose(v, slip(*c), rel_tol=1e-6) for v, c in zip(probes, ROOF_PROBES, strict=True)):
                return " " + _named(ROOF_FAULTS, fault)
    intensity, peak, bw = case
    ridge = peak * 1e3 / bw
    if math.isclose(got, peak, rel_tol=1e-6) and expected < peak:
        return " " + _named(ROOF_FAULTS, "ridge", ridge=ridge)
    if math.isclose(got, intensity * bw / 1e3, rel_tol=1e-6) and expected < got:
        return " " + _named(ROOF_FAULTS, "past the ridge", ridge=ridge)
    return ""
