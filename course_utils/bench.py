"""The benchmark harness of the course, in one namespace: ``from course_utils import bench``.

Each job lives in its own module; this one only gathers their names (import from either):

- :mod:`course_utils.timing`: :func:`time_ms` (events, warm-up, L2 flushed, median and
  percentiles) -> :class:`Timing`; :func:`time_rounds` (each implementation once per round, several
  rounds, the median round kept: how benchmarks compare implementations); ``gbps``/``tflops``.
- :mod:`course_utils.sweeps`: :func:`sweep` (implementations x cases -> DataFrame, outputs checked
  first), :func:`verify_callable`, :func:`sizes`, :func:`plot_sweep`.
- :mod:`course_utils.ceilings` (pure Python, shared with :mod:`course_utils.traffic`):
  :class:`Ceilings`, the ridge point and the roofline model; :mod:`course_utils.roofline`:
  :func:`measure_ceilings`, :func:`ceilings_for`, :func:`with_ceilings`, :func:`roofline_frame`,
  :func:`plot_roofline`.
- :mod:`course_utils.simulator`: :class:`SimulatedGPU` (the protocol on a CPU).
- :mod:`course_utils.results`: :func:`recorded`, :func:`save`, :func:`provenance`, :func:`gpu_slug`,
  :class:`Target` (pass, tie at the ceiling, short, or suspect above its ``most``; :meth:`Target.between`
  builds one from two timed rows).
"""

from __future__ import annotations

from .ceilings import Ceilings, attainable_tflops, ridge_point, roofline_seconds
from .results import (
    RESULTS,
    SUSPECT,
    TIE,
    TIE_CEILING_FRACTION,
    Target,
    ceiling_fraction,
    gpu_slug,
    provenance,
    provenance_line,
    ratio_noise,
    recorded,
    recorded_gpus,
    save,
    tie_evidence,
    topic,
)
from .roofline import ceilings_for, measure_ceilings, plot_roofline, roofline_frame, with_ceilings
from .simulator import SimEvent, SimKernel, SimulatedGPU
from .sweeps import plot_sweep, sizes, sweep, verify_callable
from .timing import (
    L2_FLUSH_BYTES,
    ROUNDS,
    TIMING_COLUMNS,
    BenchmarkError,
    Timing,
    gbps,
    median_round,
    tflops,
    time_ms,
    time_rounds,
)

__all__ = ["RESULTS", "L2_FLUSH_BYTES", "ROUNDS", "TIMING_COLUMNS", "BenchmarkError", "Timing", "time_ms",
           "time_rounds", "median_round", "gbps", "tflops", "verify_callable", "sweep", "sizes", "Ceilings",
           "ridge_point", "roofline_seconds", "measure_ceilings", "ceilings_for", "with_ceilings",
           "attainable_tflops", "roofline_frame", "plot_roofline", "plot_sweep", "SimulatedGPU", "SimKernel",
           "SimEvent", "topic", "provenance", "provenance_line", "gpu_slug", "recorded_gpus", "recorded", "save",
           "Target", "TIE", "SUSPECT", "TIE_CEILING_FRACTION", "ceiling_fraction", "ratio_noise",
           "tie_evidence"]
