"""Timing one callable by the course's protocol, and comparing several in interleaved rounds.

Protocol (chapter 8 shows each rule measured the wrong way and the right way): warm up first
(compilation, autotuning, caches), time on the device with CUDA events, flush L2 between
repetitions, report the median with the 20th and 80th percentiles, and replay a CUDA graph for
launch-bound sizes when asked to.

- :func:`time_ms` times one callable and returns a :class:`Timing`; ``device=`` takes any object
  with ``synchronize()``, ``Event()``, ``flush_l2()`` (and ``graph(fn)``), which is how
  :class:`course_utils.simulator.SimulatedGPU` lets the protocol be taught and tested on a CPU.
- :func:`time_rounds` compares implementations: each one is timed once per round, for several
  rounds, and the median round is kept, so a drift of the GPU's clocks reaches all of them alike.
- :meth:`Timing.columns` is the one naming of a timing in a results table: ``ms``, ``ms_p20``,
  ``ms_p80``.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from . import env

L2_FLUSH_BYTES = 256 * 2**20  # larger than the L2 of any GPU in the hardware table
ROUNDS = 3                    # interleaved rounds per comparison unless a benchmark asks for more
#: The columns :meth:`Timing.columns` writes, the same in every results CSV.
TIMING_COLUMNS = ("ms", "ms_p20", "ms_p80")


class BenchmarkError(RuntimeError):
    """A benchmark that cannot give a meaningful number (the callable is broken, the sweep empty)."""


@dataclass(frozen=True)
class Timing:
    """Milliseconds per call: median and the 20th/80th percentiles of the repetitions."""

    median: float
    p20: float
    p80: float
    reps: int
    cuda_graph: bool = False
    times: tuple = field(default=(), repr=False, compare=False)  # every repetition, in order

    @property
    def mean(self) -> float:
        """The mean: pulled up by slow outliers, which is why the course reports the median."""
        return statistics.fmean(self.times) if self.times else self.median

    @property
    def us(self) -> float:
        return self.median * 1e3

    def columns(self) -> dict:
        """``{"ms": median, "ms_p20": p20, "ms_p80": p80}``: how every results table names a timing."""
        return dict(zip(TIMING_COLUMNS, (self.median, self.p20, self.p80), strict=True))

    @classmethod
    def from_times(cls, times_ms: Iterable[float], cuda_graph: bool = False) -> Timing:
        """Summarize a list of per-repetition times (milliseconds)."""
        raw = tuple(float(t) for t in times_ms)
        xs = sorted(raw)
        if not xs:
            raise BenchmarkError("no repetitions to summarize: rep must be at least 1")
        if any(not math.isfinite(t) or t < 0 for t in xs):
            raise BenchmarkError(f"per-repetition times must be finite and >= 0, got {xs[:5]}...")
        return cls(statistics.median(xs), _quantile(xs, 0.2), _quantile(xs, 0.8), len(xs), cuda_graph, raw)


def _quantile(sorted_xs, q):
    return statistics.quantiles(sorted_xs, n=100, method="inclusive")[int(q * 100) - 1] \
        if len(sorted_xs) > 1 else sorted_xs[0]


class _Cuda:
    """The real device, behind the small interface :func:`time_ms` needs."""

    def __init__(self):
        self._flush = None

    def synchronize(self):
        torch.cuda.synchronize()

    def Event(self):  # noqa: N802  (mirrors torch.cuda.Event)
        return torch.cuda.Event(enable_timing=True)

    def flush_l2(self):
        if self._flush is None:
            self._flush = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
        self._flush.zero_()

    def graph(self, fn):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm-up on the capture stream
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


MAX_WARMUP_CALLS = 100_000   # warmup_ms's cap on calls, for a callable that takes no time at all
# time_rounds' warm-up of each entry on a real GPU, in ms: an H200 ran the same attention kernel 8-11% apart
# when each of three copies was timed after 2 calls, 4% apart after 100 ms (results/h200/timing_order.log)
ROUND_WARMUP_MS = 100.0


def _warm_for(fn, warmup_ms: float, device) -> None:
    """Call ``fn`` for about ``warmup_ms`` milliseconds: one call timed (device events, and the host's clock
    for a call that the launch, not the kernel, makes long), then repeated."""
    start, end = device.Event(), device.Event()
    t0 = time.perf_counter()
    start.record()
    fn()
    end.record()
    device.synchronize()
    per_call = max(start.elapsed_time(end), (time.perf_counter() - t0) * 1e3, 1e-3)
    for _ in range(min(math.ceil(warmup_ms / per_call), MAX_WARMUP_CALLS)):
        fn()


def time_ms(fn, *, warmup: int = 10, rep: int = 50, flush_l2: bool = True, cuda_graph: bool = False,
            device=None, graph_calls: int = 20, warmup_ms: float = 0.0) -> Timing:
    """Time ``fn()`` on the GPU by the course's protocol and return a :class:`Timing`.

    ``cuda_graph=True`` captures ``graph_calls`` back-to-back calls of ``fn`` in one CUDA graph,
    times each replay and divides by ``graph_calls``: the host's launch overhead and the gap
    between an event and the kernel after it are gone, which is what a launch-bound size needs
    (say so when you report it; the calls inside one replay share L2). ``device`` is the real GPU
    when None, or a stand-in with the same interface (``SimulatedGPU``). ``warmup_ms``: after the
    ``warmup`` calls, keep calling ``fn`` for about this long (a clock that follows the load settles in
    tens of milliseconds, not in ten calls of a short kernel).
    """
    if not callable(fn):
        raise TypeError(f"time_ms needs a callable taking no arguments, got {type(fn).__name__}")
    if int(warmup) != warmup or warmup < 0:
        raise ValueError(f"warmup must be an integer >= 0, got {warmup!r}")
    if int(rep) != rep or rep < 1:
        raise ValueError(f"rep must be an integer >= 1, got {rep!r}")
    if device is None:
        if not env.on_gpu():
            raise RuntimeError("bench.time_ms times a real GPU; under the interpreter use "
                               "bench.recorded(name), or pass device=bench.SimulatedGPU()")
        device = _Cuda()
    try:
        fn()  # the first call compiles (and counts as one warm-up call)
    except Exception as e:
        raise BenchmarkError(f"the callable {_name(fn)} raised {type(e).__name__} on its first call: {e}. "
                             "A benchmark times working code: call it once by hand and fix it first.") from e
    for _ in range(warmup - 1):
        fn()
    if warmup_ms > 0:
        _warm_for(fn, warmup_ms, device)
    device.synchronize()
    calls = 1
    run = fn
    if cuda_graph:
        if int(graph_calls) != graph_calls or graph_calls < 1:
            raise ValueError(f"graph_calls must be an integer >= 1, got {graph_calls!r}")
        calls = int(graph_calls)
        run = device.graph(lambda: [fn() for _ in range(calls)])
    starts = [device.Event() for _ in range(rep)]
    ends = [device.Event() for _ in range(rep)]
    for i in range(rep):
        if flush_l2:
            device.flush_l2()
        starts[i].record()
        run()
        ends[i].record()
    device.synchronize()
    return Timing.from_times((s.elapsed_time(e) / calls for s, e in zip(starts, ends, strict=True)), cuda_graph)


def gbps(nbytes: int, t: Timing | float) -> float:
    """GB/s (1e9 bytes per second) for ``nbytes`` moved in ``t`` (a Timing or milliseconds)."""
    ms = t.median if isinstance(t, Timing) else t
    return nbytes / (ms * 1e-3) / 1e9


def tflops(flops: float, t: Timing | float) -> float:
    """TFLOP/s for ``flops`` done in ``t`` (a Timing or milliseconds)."""
    ms = t.median if isinstance(t, Timing) else t
    return flops / (ms * 1e-3) / 1e12


# ---------------------------------------------------------------------------------------------
# Interleaved rounds: the one way the course compares implementations


def median_round(timings: Iterable[Timing]) -> Timing:
    """The round whose median is the median of the rounds' medians (the lower one for an even count)."""
    ts = sorted(timings, key=lambda t: t.median)
    if not ts:
        raise BenchmarkError("no rounds to choose from")
    return ts[(len(ts) - 1) // 2]


def balanced_orders(n: int, rounds: int) -> list[list[int]]:
    """``rounds`` orders of ``range(n)``, the rows of a Williams square: row ``i`` is 0, 1, n-1, 2, n-2...
    shifted by ``i``, so from one round to the next every entry comes after a different neighbour (over n
    rounds, n even, each after every other once) and sits at a different place."""
    base, lo, hi = [0], 1, n - 1
    while len(base) < n:
        base.append(lo)
        lo += 1
        if len(base) < n:
            base.append(hi)
            hi -= 1
    return [[(b + i) % n for b in base] for i in range(rounds)]


def time_rounds(impls: Mapping, rounds: int = ROUNDS, *, timer: Callable | None = None,
                errors: dict | None = None, before_round: Callable | None = None, balance: bool = True,
                **time_kw) -> dict:
    """Time every implementation once per round for ``rounds`` rounds; keep each one's median round.

    ``impls`` maps a key (a name, or a tuple such as ``(impl, "graph")``) to the zero-argument
    callable to time, or to a pair ``(callable, timer)`` when that entry needs its own timer (a
    CUDA-graph or wall-clock timing beside event timings). ``timer(fn, **time_kw)`` returns a
    :class:`Timing` (default :func:`time_ms`). Timing A, B, C, B, C, A... instead of A, A, A, B...
    means a drift of the clocks or of the host over the run reaches every implementation alike, so
    their ratio is what one run can honestly report.

    ``errors``: when a dict, an entry that raises is recorded there (key -> ``"Type: message"``)
    and left out of later rounds and of the result; when None, the exception propagates.
    ``before_round(i)``: called before round ``i`` (chapter 12's benchmark moves its threads to the fastest
    core of the moment there: a host's cores change speed over minutes).
    ``balance`` (the default): round ``i`` runs in the order of :func:`balanced_orders`' row ``i``, so no
    entry is always timed right after the same neighbour nor always at the same place: a power-limited GPU
    runs a kernel faster just after a lighter one. ``balance=False``: every round in the given order.
    On a real GPU with the default timer each entry first runs for :data:`ROUND_WARMUP_MS` (``warmup_ms=``
    changes it), so it is timed at the clock its own load settles to, not at the one its neighbour left.
    Returns ``{key: Timing}`` in the order of ``impls``.
    """
    if int(rounds) != rounds or rounds < 1:
        raise ValueError(f"rounds must be an integer >= 1, got {rounds!r}")
    if not impls:
        raise BenchmarkError("time_rounds: no implementations to time")
    default = timer or time_ms
    plan = {}
    for key, value in impls.items():
        fn, own = value if isinstance(value, tuple) else (value, None)
        if not callable(fn):
            raise TypeError(f"time_rounds: {key!r} must be a callable or (callable, timer), got {value!r}")
        plan[key] = (fn, own)
    runs: dict = {key: [] for key in plan}
    if timer is None and time_kw.get("device") is None:
        time_kw.setdefault("warmup_ms", ROUND_WARMUP_MS)
    keys = list(plan)
    orders = balanced_orders(len(keys), int(rounds)) if balance else [range(len(keys))] * int(rounds)
    for i, order in enumerate(orders):
        if before_round is not None:
            before_round(i)
        for key in (keys[j] for j in order):
            fn, own = plan[key]
            if key not in runs:
                continue
            try:
                runs[key].append(own(fn) if own is not None else default(fn, **time_kw))
            except Exception as e:
                if errors is None:
                    raise
                errors[key] = f"{type(e).__name__}: {e}"[:300]
                del runs[key]
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
    return {key: median_round(ts) for key, ts in runs.items()}


__all__ = ["L2_FLUSH_BYTES", "ROUNDS", "ROUND_WARMUP_MS", "TIMING_COLUMNS", "BenchmarkError", "Timing", "time_ms",
           "gbps", "tflops", "median_round", "balanced_orders", "time_rounds"]
