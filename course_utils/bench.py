"""The one benchmark harness of the course.

Protocol (chapter 8 shows each rule measured the wrong way and the right way): warm up first
(compilation, autotuning, caches), time on the device with CUDA events, flush L2 between
repetitions, report the median with the 20th and 80th percentiles, and replay a CUDA graph for
launch-bound sizes when asked to. Under the interpreter nothing is timed: :func:`recorded` returns
what a real GPU measured, from ``results/<gpu>/<name>.csv``.

What is here, in order:

- :func:`time_ms` times one callable by that protocol and returns a :class:`Timing`; ``device=``
  takes any object with ``synchronize()``, ``Event()``, ``flush_l2()`` (and ``graph(fn)``), which
  is how :class:`SimulatedGPU` lets the protocol be taught, tested and graded on a CPU.
- :func:`sweep` times implementations over a list of cases and returns a pandas DataFrame with
  GB/s or TFLOP/s (outputs are checked first: a callable that raises, returns nothing or changes
  its answer between calls is reported, not timed).
- :class:`Ceilings`, :func:`measure_ceilings`, :func:`ceilings_for`, :func:`with_ceilings`: the
  measured copy bandwidth and matmul rate, and each row's % of them.
- :func:`attainable_tflops`, :func:`roofline_frame`, :func:`plot_roofline`: the roofline.
- :func:`plot_sweep`: one line per implementation.
- :func:`recorded`, :func:`save`, :func:`provenance`, :func:`gpu_slug`: results on disk.
- :class:`Target`: a speed target of a chapter issue as ``make bench`` judges it.
"""

from __future__ import annotations

import datetime as _dt
import math
import random
import statistics
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import env

RESULTS = Path(__file__).resolve().parent.parent / "results"
L2_FLUSH_BYTES = 256 * 2**20  # larger than the L2 of any GPU in the hardware table


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


def time_ms(fn, *, warmup: int = 10, rep: int = 50, flush_l2: bool = True, cuda_graph: bool = False,
            device=None, graph_calls: int = 20) -> Timing:
    """Time ``fn()`` on the GPU by the course's protocol and return a :class:`Timing`.

    ``cuda_graph=True`` captures ``graph_calls`` back-to-back calls of ``fn`` in one CUDA graph,
    times each replay and divides by ``graph_calls``: the host's launch overhead and the gap
    between an event and the kernel after it are gone, which is what a launch-bound size needs
    (say so when you report it; the calls inside one replay share L2). ``device`` is the real GPU
    when None, or a stand-in with the same interface (:class:`SimulatedGPU`).
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
    ms = t.median if isinstance(t, Timing) else t
    return flops / (ms * 1e-3) / 1e12


# ---------------------------------------------------------------------------------------------
# Sweeps: implementations x cases -> DataFrame


def _outputs_equal(a, b) -> tuple[bool, str]:
    """Compare two outputs of one callable (tensors, or tuples/lists of them)."""
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            ok, why = _outputs_equal(x, y)
            if not ok:
                return False, f"output {i}: {why}"
        return True, ""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape:
            return False, f"shape {tuple(a.shape)} then {tuple(b.shape)}"
        if a.is_floating_point():
            from .check import tolerance
            atol, rtol = tolerance(a.dtype) if a.dtype in (torch.float16, torch.bfloat16, torch.float32,
                                                           torch.float64) else (0.0, 0.0)
            same = torch.isclose(a.double(), b.double(), atol=atol, rtol=rtol, equal_nan=True)
        else:
            same = a == b
        if not bool(same.all()):
            return False, f"{int((~same).sum())} of {a.numel()} elements changed"
        return True, ""
    return (a == b, f"{a!r} then {b!r}") if not isinstance(a, torch.Tensor) else (False, "type changed")


def verify_callable(fn, what: str = "") -> None:
    """Raise :class:`BenchmarkError` unless ``fn()`` runs, returns something, and returns the same twice.

    A callable that returns nothing cannot be checked (it may do nothing at all, fast); one whose
    result changes between calls on the same inputs has a race, reads uninitialised memory, or
    mutates its own inputs, and its time means nothing.
    """
    what = what or _name(fn)
    try:
        first = fn()
        if isinstance(first, torch.Tensor):
            first = first.clone()
        elif isinstance(first, (tuple, list)):
            first = type(first)(t.clone() if isinstance(t, torch.Tensor) else t for t in first)
        second = fn()
    except Exception as e:
        raise BenchmarkError(f"{what} raised {type(e).__name__}: {e}") from e
    if first is None or second is None:
        raise BenchmarkError(f"{what} returned nothing: return its output so the sweep can check that "
                             "it computes something (in-place ops: return the tensor they wrote)")
    ok, why = _outputs_equal(first, second)
    if not ok:
        raise BenchmarkError(f"{what} is not deterministic: two calls on the same inputs disagree ({why}). "
                             "Does it read memory it never wrote, race, or change its own inputs?")


def _progress(iterable, desc: str, enabled: bool, total: int | None = None):
    if not enabled:
        return iterable
    from tqdm.auto import tqdm
    return tqdm(iterable, desc=desc, total=total, leave=False)


def sweep(cases: Iterable[Mapping], impls: Mapping[str, Callable], *, nbytes: Callable | None = None,
          flops: Callable | None = None, verify: bool = True, progress: bool = True,
          desc: str = "sweep", timer: Callable | None = None, **time_kw):
    """Time every implementation on every case and return one DataFrame row per (case, impl).

    ``impls[name](case)`` does the set-up (allocation, inputs) and returns the zero-argument
    callable to time. ``nbytes(case)`` (minimum bytes moved) gives a ``gbps`` column and
    ``flops(case)`` a ``tflops`` column. A case an implementation cannot run (it raises in set-up
    or in the check, out of memory, say) becomes a row with its ``error`` and no time.
    ``timer`` replaces :func:`time_ms` (tests, simulations); ``time_kw`` goes to it.
    """
    import pandas as pd

    cases = [dict(c) for c in cases]
    if not cases:
        raise BenchmarkError(f"{desc}: empty sweep (no cases); check the range of sizes you asked for")
    if not impls:
        raise BenchmarkError(f"{desc}: no implementations to time")
    timer = timer or time_ms
    rows = []
    work = [(c, name, make) for c in cases for name, make in impls.items()]
    for case, name, make in _progress(work, desc, progress):
        row = {**case, "impl": name}
        try:
            fn = make(case)
            if verify:
                verify_callable(fn, f"{name} on {case}")
            t = timer(fn, **time_kw)
        except Exception as e:  # out of memory, too much shared memory, a broken callable...
            rows.append({**row, "ms": math.nan, "error": f"{type(e).__name__}: {e}"[:300]})
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            continue
        row.update(ms=t.median, p20_ms=t.p20, p80_ms=t.p80, reps=t.reps, cuda_graph=t.cuda_graph)
        if nbytes is not None:
            row["bytes"] = nbytes(case)
            row["gbps"] = gbps(row["bytes"], t)
        if flops is not None:
            row["flops"] = flops(case)
            row["tflops"] = tflops(row["flops"], t)
        row["error"] = ""
        rows.append(row)
    return pd.DataFrame(rows)


def sizes(start: int, stop: int, factor: int = 2) -> list[int]:
    """Geometric range ``start, start*factor, ...`` up to ``stop`` inclusive (never empty silently)."""
    if start < 1 or stop < start or factor < 2:
        raise BenchmarkError(f"empty or invalid size range: start={start}, stop={stop}, factor={factor}")
    out, n = [], start
    while n <= stop:
        out.append(n)
        n *= factor
    return out


# ---------------------------------------------------------------------------------------------
# Ceilings and the roofline


@dataclass(frozen=True)
class Ceilings:
    """What the GPU in hand really does: copy bandwidth (read + written) and a dense matmul rate."""

    gpu: str
    copy_gbps: float
    matmul_tflops: float
    matmul_dtype: str = "bfloat16"
    source: str = "measured"   # "measured", or "datasheet" when nothing could be measured
    note: str = ""

    def row(self) -> dict:
        row = {"gpu": self.gpu, "copy_gbps": self.copy_gbps, "matmul_tflops": self.matmul_tflops,
               "matmul_dtype": self.matmul_dtype, "source": self.source, "note": self.note}
        if self.matmul_dtype == "bfloat16":
            row["matmul_bf16_tflops"] = self.matmul_tflops  # the column benchmarks/launch_overhead writes
        return row

    @classmethod
    def from_frame(cls, df) -> Ceilings:
        """Ceilings from a recorded ``ceilings.csv`` (first row), e.g. ``recorded("ceilings")``."""
        if df is None or len(df) == 0:
            raise ValueError("no ceilings in this frame")
        r = df.iloc[0]
        tflops = r["matmul_tflops"] if "matmul_tflops" in df.columns else r["matmul_bf16_tflops"]
        dtype = r["matmul_dtype"] if "matmul_dtype" in df.columns else "bfloat16"
        gpu = str(r["gpu"]) if "gpu" in df.columns else "unknown GPU"
        note = r["note"] if "note" in df.columns and isinstance(r["note"], str) else ""
        source = r["source"] if "source" in df.columns and isinstance(r["source"], str) else "measured"
        return cls(gpu, float(r["copy_gbps"]), float(tflops), str(dtype), source, note)

    @property
    def ridge(self) -> float:
        """FLOP per byte where the roofline turns from memory- to compute-bound."""
        return self.matmul_tflops * 1e12 / (self.copy_gbps * 1e9)


def measure_ceilings(copy_bytes: int = 2**30, matmul_n: int = 8192) -> Ceilings:
    """Measure the copy bandwidth and the matmul rate of the GPU in hand (about 2 s on an H100)."""
    from . import hardware
    if not env.on_gpu():
        raise RuntimeError("measure_ceilings needs a GPU; under the interpreter read recorded('ceilings')")
    dtype = torch.bfloat16 if torch.bfloat16 in env.supported_dtypes() else torch.float16
    return ceilings_for(env.device_name(), hardware.measure_copy_gbps(copy_bytes),
                        hardware.measure_matmul_tflops(matmul_n, dtype), str(dtype).removeprefix("torch."))


def ceilings_for(gpu: str, copy_gbps: float | None = None, matmul_tflops: float | None = None,
                 matmul_dtype: str = "bfloat16") -> Ceilings:
    """Ceilings for ``gpu``: the measured ones when given, else the datasheet's, with a note saying which.

    A GPU missing from the hardware table is fine when both ceilings were measured (the note says
    so); without measurements there is nothing to fall back on and this raises ``ValueError``.
    """
    from . import hardware
    try:
        spec = hardware.lookup(gpu)
    except ValueError:
        spec = None
    measured = copy_gbps is not None and matmul_tflops is not None
    for label, v in (("copy_gbps", copy_gbps), ("matmul_tflops", matmul_tflops)):
        if v is not None and (not math.isfinite(v) or v <= 0):
            raise ValueError(f"{label} must be a positive number, got {v!r}")
    if measured:
        if spec is None:
            note = f"{gpu} is not in the hardware table: using the measured ceilings only"
        else:
            dt = matmul_dtype if matmul_dtype in spec.tflops else "float16"
            peak = spec.tflops[dt]
            note = (f"measured; datasheet {spec.hbm_gbps:.0f} GB/s and {peak:.0f} TFLOP/s {dt} "
                    f"(measured {100 * copy_gbps / spec.hbm_gbps:.0f}% and {100 * matmul_tflops / peak:.0f}% "
                    "of them)")
        return Ceilings(gpu, float(copy_gbps), float(matmul_tflops), matmul_dtype, "measured", note)
    if spec is None:
        raise ValueError(f"{gpu!r} is not in the hardware table and no ceilings were measured: "
                         "measure them on the GPU (bench.measure_ceilings()) and pass them in")
    dt = matmul_dtype if matmul_dtype in spec.tflops else "float16"
    return Ceilings(gpu, copy_gbps or spec.hbm_gbps, matmul_tflops or spec.tflops[dt], dt, "datasheet",
                    "datasheet peaks (nothing measured): real kernels reach less; measure on the GPU")


def with_ceilings(df, ceilings: Ceilings):
    """Add ``pct_of_copy`` (GB/s rows) and ``pct_of_matmul`` (TFLOP/s rows) to a sweep's DataFrame."""
    df = df.copy()
    if "gbps" in df.columns:
        df["pct_of_copy"] = 100 * df["gbps"] / ceilings.copy_gbps
    if "tflops" in df.columns:
        df["pct_of_matmul"] = 100 * df["tflops"] / ceilings.matmul_tflops
    return df


def attainable_tflops(intensity: float, peak_tflops: float, bw_gbps: float) -> float:
    """The roofline: min(peak, intensity x bandwidth), with intensity in FLOP per byte."""
    for label, v in (("intensity", intensity), ("peak_tflops", peak_tflops), ("bw_gbps", bw_gbps)):
        if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{label} must be a finite number >= 0, got {v!r}")
    return min(peak_tflops, intensity * bw_gbps * 1e9 / 1e12)


def roofline_frame(points, ceilings: Ceilings):
    """Place kernels on the roofline.

    ``points`` is a DataFrame (or list of dicts) with ``name``, ``flops``, ``bytes`` and ``ms``.
    Adds ``intensity`` (FLOP/byte), ``tflops`` achieved, ``attainable_tflops``, ``pct_of_attainable``
    and ``bound`` ("memory" left of the ridge, "compute" right of it).
    """
    import pandas as pd

    df = pd.DataFrame(points).copy()
    missing = {"name", "flops", "bytes", "ms"} - set(df.columns)
    if missing:
        raise ValueError(f"roofline points need columns name, flops, bytes, ms; missing {sorted(missing)}")
    if df.empty:
        raise ValueError("no kernels to place on the roofline")
    if (df["bytes"] <= 0).any() or (df["ms"] <= 0).any():
        raise ValueError("every roofline point needs bytes > 0 and ms > 0")
    df["intensity"] = df["flops"] / df["bytes"]
    df["tflops"] = df["flops"] / (df["ms"] * 1e-3) / 1e12
    df["gbps"] = df["bytes"] / (df["ms"] * 1e-3) / 1e9
    df["attainable_tflops"] = [attainable_tflops(float(i), ceilings.matmul_tflops, ceilings.copy_gbps)
                               for i in df["intensity"]]
    df["pct_of_attainable"] = 100 * df["tflops"] / df["attainable_tflops"].where(df["attainable_tflops"] > 0)
    # kernels that do no arithmetic (a copy) are judged on bandwidth
    zero = df["flops"] == 0
    df.loc[zero, "pct_of_attainable"] = 100 * df.loc[zero, "gbps"] / ceilings.copy_gbps
    df["bound"] = ["memory" if i < ceilings.ridge else "compute" for i in df["intensity"]]
    return df


def plot_roofline(df, ceilings: Ceilings, ax=None, title: str | None = None):
    """Log-log roofline of ``ceilings`` with the points of :func:`roofline_frame` placed on it."""
    import matplotlib.pyplot as plt
    import numpy as np

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 5))
    positive = df["intensity"][df["intensity"] > 0]
    lo = min(0.05, float(positive.min()) / 2) if len(positive) else 0.05
    hi = max(ceilings.ridge * 8, float(df["intensity"].max()) * 2)
    xs = np.logspace(math.log10(lo), math.log10(hi), 200)
    ax.loglog(xs, [attainable_tflops(float(x), ceilings.matmul_tflops, ceilings.copy_gbps) for x in xs],
              "k-", lw=2, label=f"roofline ({ceilings.source})")
    ax.axvline(ceilings.ridge, color="grey", ls=":", lw=1)
    ax.text(ceilings.ridge, ceilings.matmul_tflops * 1.15, f"ridge {ceilings.ridge:.0f} FLOP/B",
            ha="center", fontsize=8)
    for _, r in df[df["tflops"] > 0].iterrows():  # a copy does no arithmetic: no point on a log axis
        x = max(float(r["intensity"]), lo)
        ax.plot(x, r["tflops"], "o")
        ax.annotate(f"{str(r['name']).split(' (')[0]} ({r['pct_of_attainable']:.0f}%)", (x, r["tflops"]),
                    fontsize=7, xytext=(4, -3), textcoords="offset points")
    ax.set_xlabel("arithmetic intensity (FLOP per byte of DRAM traffic)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(title or f"Roofline of {ceilings.gpu}: {ceilings.copy_gbps:.0f} GB/s copy, "
                 f"{ceilings.matmul_tflops:.0f} TFLOP/s {ceilings.matmul_dtype} matmul")
    ax.grid(True, which="both", alpha=0.3)
    return ax


def plot_sweep(df, x: str, y: str = "gbps", hue: str = "impl", ax=None, logx: bool = True,
               title: str | None = None, ceiling: float | None = None):
    """One line per ``hue`` value of ``y`` against ``x`` (rows with an error are left out)."""
    import matplotlib.pyplot as plt

    if x not in df.columns or y not in df.columns:
        raise ValueError(f"plot_sweep: no column {x!r} or {y!r} (columns: {list(df.columns)})")
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    ok = df[df["ms"].notna()] if "ms" in df.columns else df
    for name, g in ok.groupby(hue, sort=False):
        g = g.sort_values(x)
        ax.plot(g[x], g[y], "o-", label=str(name))
    if ceiling is not None:
        ax.axhline(ceiling, color="k", ls="--", lw=1, label="measured ceiling")
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(x)
    ax.set_ylabel({"gbps": "GB/s", "tflops": "TFLOP/s", "ms": "ms"}.get(y, y))
    if title:
        ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return ax


# ---------------------------------------------------------------------------------------------
# A simulated GPU: the protocol on a CPU


class SimulatedGPU:
    """A toy GPU with a host clock, an asynchronous queue, JIT compilation, an L2 cache and noise.

    It has the interface :func:`time_ms` uses (``synchronize``, ``Event``, ``flush_l2``, ``graph``)
    plus ``host_time()`` (a host clock in ms, like ``time.perf_counter() * 1e3``), and
    ``kernel(nbytes)`` makes a kernel that moves ``nbytes``. Nothing really runs; time only
    advances in the model, so each mistake of chapter 8 gives its wrong number deterministically:
    reading the host clock without a sync measures the queue, the first call includes compilation,
    a working set that stays in L2 runs at L2 speed, a few repetitions are slowed down by
    ``spike`` (the mean moves, the median does not), and every launch costs ``launch_us`` on the host.
    """

    def __init__(self, *, hbm_gbps: float = 3000.0, l2_gbps: float = 9000.0, l2_bytes: int = 50 * 2**20,
                 launch_us: float = 8.0, latency_us: float = 2.0, jit_ms: float = 150.0,
                 noise: float = 0.01, spike_prob: float = 0.1, spike: float = 3.0, sync_us: float = 5.0,
                 seed: int = 0):
        if min(hbm_gbps, l2_gbps, l2_bytes) <= 0:
            raise ValueError("bandwidths and the L2 size must be positive")
        self.hbm_gbps, self.l2_gbps, self.l2_bytes = hbm_gbps, l2_gbps, l2_bytes
        self.launch_us, self.latency_us, self.jit_ms, self.sync_us = launch_us, latency_us, jit_ms, sync_us
        self.noise, self.spike_prob, self.spike = noise, spike_prob, spike
        self._rng = random.Random(seed)
        self._host = 0.0        # ms
        self._queue_end = 0.0   # ms: when the GPU finishes what is queued
        self._cached: dict[int, int] = {}  # kernel id -> bytes resident in L2 (insertion order = LRU)
        self._capturing: list | None = None
        self.kernels: list[SimKernel] = []
        self.launches = 0
        self.flushes = 0
        self.syncs = 0
        self.host_reads = 0
        self.events = 0

    # host side
    def host_time(self) -> float:
        """The host's clock in milliseconds (what ``time.perf_counter()`` would read)."""
        self.host_reads += 1
        return self._host

    def synchronize(self) -> None:
        """Wait until the GPU has finished everything queued."""
        self.syncs += 1
        self._host = max(self._host, self._queue_end) + self.sync_us * 1e-3

    def Event(self, enable_timing: bool = True) -> SimEvent:  # noqa: N802  (mirrors torch.cuda.Event)
        self.events += 1
        return SimEvent(self)

    def kernel(self, nbytes: int, name: str = "") -> SimKernel:
        """A kernel that moves ``nbytes`` through DRAM (or L2, when they are still there)."""
        if int(nbytes) != nbytes or nbytes <= 0:
            raise ValueError(f"nbytes must be a positive integer, got {nbytes!r}")
        k = SimKernel(self, int(nbytes), name or f"kernel{len(self.kernels)}")
        self.kernels.append(k)
        return k

    def true_ms(self, k: SimKernel) -> float:
        """What a correct benchmark of ``k`` reports: cold L2, no launch overhead, no noise."""
        return self.latency_us * 1e-3 + k.nbytes / (self.hbm_gbps * 1e9) * 1e3

    def flush_l2(self) -> None:
        """Queue a kernel that writes a buffer larger than L2 (like :func:`time_ms`), evicting everything.

        It takes long enough that the host has launched the next kernel before it ends, so the
        launch overhead stays out of the event-timed region, as on a real GPU.
        """
        flush_bytes = max(L2_FLUSH_BYTES, 2 * self.l2_bytes)
        self._enqueue(flush_bytes / (self.hbm_gbps * 1e9) * 1e3, launch=True)
        self._cached.clear()
        self.flushes += 1

    def graph(self, fn):
        """Capture ``fn``'s launches once; replaying them costs one launch on the host."""
        self._capturing = []
        try:
            fn()
        finally:
            captured, self._capturing = self._capturing, None

        def replay():
            self._host += self.launch_us * 1e-3
            for k in captured:
                self._enqueue(k._duration(), launch=False)
        return replay

    # device side
    def _enqueue(self, ms: float, launch: bool = True) -> None:
        if launch:
            self._host += self.launch_us * 1e-3
        start = max(self._host, self._queue_end)
        self._queue_end = start + ms


class SimKernel:
    """A kernel of :class:`SimulatedGPU`: calling it launches it (asynchronously)."""

    def __init__(self, gpu: SimulatedGPU, nbytes: int, name: str):
        self.gpu, self.nbytes, self.__name__ = gpu, nbytes, name
        self.compiled = False
        self.calls = 0

    def _duration(self) -> float:
        g = self.gpu
        warm = self.nbytes <= g.l2_bytes and id(self) in g._cached
        bw = g.l2_gbps if warm else g.hbm_gbps
        ms = g.latency_us * 1e-3 + self.nbytes / (bw * 1e9) * 1e3
        ms *= 1 + g.noise * g._rng.gauss(0, 1)
        if g._rng.random() < g.spike_prob:
            ms *= g.spike
        # what it touched is now in L2 (a working set larger than L2 leaves nothing useful there)
        g._cached.pop(id(self), None)
        if self.nbytes <= g.l2_bytes:
            g._cached[id(self)] = self.nbytes
            while sum(g._cached.values()) > g.l2_bytes:
                g._cached.pop(next(iter(g._cached)))
        else:
            g._cached.clear()
        return max(ms, 1e-6)

    def __call__(self):
        g = self.gpu
        self.calls += 1
        if not self.compiled:
            g._host += g.jit_ms  # the first call compiles, on the host
            self.compiled = True
        if g._capturing is not None:
            g._capturing.append(self)
            return None
        g.launches += 1
        g._enqueue(self._duration())
        return None


class SimEvent:
    """Like ``torch.cuda.Event``: ``record()`` marks the queue, ``elapsed_time`` needs both done."""

    def __init__(self, gpu: SimulatedGPU):
        self.gpu = gpu
        self.t: float | None = None

    def record(self) -> None:
        self.t = max(self.gpu._host, self.gpu._queue_end)

    def query(self) -> bool:
        return self.t is not None and self.gpu._host >= self.t

    def synchronize(self) -> None:
        if self.t is None:
            raise RuntimeError("event was never recorded")
        self.gpu._host = max(self.gpu._host, self.t)

    def elapsed_time(self, end: SimEvent) -> float:
        if self.t is None or end.t is None:
            raise RuntimeError("elapsed_time: both events must be recorded first")
        if not (self.query() and end.query()):
            raise RuntimeError("elapsed_time: the events have not completed yet; call synchronize() "
                               "first (CUDA raises 'device not ready' here)")
        return end.t - self.t


# ---------------------------------------------------------------------------------------------
# Results on disk


def topic(name: str):
    """The benchmark module ``benchmarks/<name>.py`` of this checkout: notebooks call its measuring
    functions on a GPU and show :func:`recorded` results without one."""
    import importlib
    import sys

    root = str(RESULTS.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    return importlib.import_module(f"benchmarks.{name}")


def provenance() -> dict:
    """Where a measurement comes from: GPU, versions and date."""
    v = env.versions()
    return {"gpu": env.device_name(), "torch": v["torch"], "triton": v["triton"],
            "date": _dt.date.today().isoformat()}


def provenance_line(df) -> str:
    """'measured on <gpu> (torch ..., triton ..., <date>)' from a results DataFrame's columns."""
    cols = [c for c in ("gpu", "torch", "triton", "date") if c in df.columns]
    if "gpu" not in cols or df.empty:
        return "provenance unknown (no gpu column)"
    first = df.iloc[0]
    rest = ", ".join(f"{c} {first[c]}" for c in cols[1:] if c != "date")
    date = f", {first['date']}" if "date" in cols else ""
    return f"measured on {first['gpu']} ({rest}{date})"


def gpu_slug(name: str | None = None) -> str:
    """Folder name under results/ for a GPU name: 'NVIDIA H100 80GB HBM3' -> 'h100-80gb-hbm3'."""
    name = (name or env.device_name()).lower().replace("nvidia", "").strip()
    return "-".join(part for part in name.replace("_", " ").split() if part)


def recorded_gpus() -> list[str]:
    """Folders under results/ that hold recorded measurements, H100 first."""
    if not RESULTS.exists():
        return []
    dirs = sorted(p.name for p in RESULTS.iterdir() if p.is_dir() and any(p.glob("*.csv")))
    return sorted(dirs, key=lambda s: (not s.startswith("h100"), s))


def recorded(name: str, gpu: str | None = None):
    """The recorded results ``results/<gpu>/<name>.csv`` as a DataFrame (first GPU that has them)."""
    import pandas as pd

    for slug in ([gpu] if gpu else recorded_gpus()):
        path = RESULTS / slug / f"{name}.csv"
        if path.exists():
            df = pd.read_csv(path)
            df.attrs["gpu_folder"] = slug
            return df
    raise FileNotFoundError(f"no recorded results named {name!r} under {RESULTS} (GPUs: {recorded_gpus()})")


def save(df, name: str, gpu: str | None = None, root: Path | None = None) -> Path:
    """Write a results DataFrame to ``results/<gpu>/<name>.csv`` with provenance columns."""
    slug = gpu or gpu_slug()
    path = (root or RESULTS) / slug / f"{name}.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    df = df.copy()
    for k, v in provenance().items():
        if k not in df.columns:
            df[k] = v
    df.to_csv(path, index=False)
    return path


@dataclass(frozen=True)
class Target:
    """One speed target of a chapter issue, as ``make bench`` judges it.

    ``measured`` and ``required`` are ratios measured in one run on one GPU (ours / theirs).
    """

    issue: int
    claim: str      # e.g. "gelu bf16 256 MiB vs copy_ bandwidth"
    measured: float
    required: float

    @property
    def passed(self) -> bool:
        return self.measured >= self.required

    def row(self) -> dict:
        return {"issue": self.issue, "target": self.claim, "required": self.required,
                "measured": round(self.measured, 3), "status": "pass" if self.passed else "short"}


__all__ = ["RESULTS", "L2_FLUSH_BYTES", "BenchmarkError", "Timing", "time_ms", "gbps", "tflops",
           "verify_callable", "sweep", "sizes", "Ceilings", "measure_ceilings", "ceilings_for",
           "with_ceilings", "attainable_tflops", "roofline_frame", "plot_roofline", "plot_sweep",
           "SimulatedGPU", "SimKernel", "SimEvent", "topic", "provenance", "provenance_line", "gpu_slug",
           "recorded_gpus", "recorded", "save", "Target"]
