"""A machine's ceilings and the roofline model: the one type and the one formula the course uses.

Pure Python (no torch), so :mod:`course_utils.traffic` can use it as well as :mod:`course_utils.bench`.

- :class:`Ceilings`: a GPU's copy bandwidth (bytes read + written per second), its dense matmul
  rate, and, for the time model, its L2 size and the host's launch overhead. Measured
  (``bench.measure_ceilings()``), recorded (``Ceilings.from_frame(bench.recorded("ceilings"))``) or
  from the datasheet (``bench.ceilings_for(gpu)``, ``traffic.machine(gpu)``).
- :func:`ridge_point`: the arithmetic intensity where memory-bound turns compute-bound.
- :func:`roofline_seconds` and :func:`attainable_tflops`: the roofline, as a time for one kernel
  (``max(bytes / bandwidth, flops / peak)``) and as the rate it allows at an intensity. They are
  the same model: ``flops / max(bytes / bw, flops / peak) == min(peak, intensity x bw)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def _positive(label: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{label} must be a positive number, got {v!r}")
    return float(v)


def ridge_point(peak_tflops: float, bw_gbps: float) -> float:
    """FLOP per byte at which the roofline turns from memory- to compute-bound: peak / bandwidth."""
    return _positive("peak_tflops", peak_tflops) * 1e12 / (_positive("bw_gbps", bw_gbps) * 1e9)


def roofline_seconds(nbytes: float, flops: float, bw_gbps: float, peak_tflops: float) -> tuple[float, float]:
    """(memory seconds, compute seconds) of one kernel; the roofline's time is their maximum."""
    return nbytes / (bw_gbps * 1e9), flops / (peak_tflops * 1e12)


def attainable_tflops(intensity: float, peak_tflops: float, bw_gbps: float) -> float:
    """The roofline: min(peak, intensity x bandwidth), with intensity in FLOP per byte."""
    for label, v in (("intensity", intensity), ("peak_tflops", peak_tflops), ("bw_gbps", bw_gbps)):
        if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{label} must be a finite number >= 0, got {v!r}")
    return min(peak_tflops, intensity * bw_gbps * 1e9 / 1e12)


@dataclass(frozen=True)
class Ceilings:
    """What a GPU does at most: copy bandwidth (read + written), a dense matmul rate, its L2 and the
    host's cost per launch (None: the recorded one, :func:`course_utils.traffic.launch_overhead`).

    ``source`` says where the numbers come from: "measured", "recorded" or "datasheet".
    The time model's names are aliases: ``name`` (gpu), ``hbm_gbps`` (copy_gbps), ``peak_tflops``
    (matmul_tflops).
    """

    gpu: str
    copy_gbps: float
    matmul_tflops: float
    matmul_dtype: str = "bfloat16"
    source: str = "measured"   # "measured", "recorded", or "datasheet" when nothing could be measured
    note: str = ""
    l2_bytes: int = 0
    launch_us: float | None = None

    def __post_init__(self):
        _positive("copy_gbps", self.copy_gbps)
        _positive("matmul_tflops", self.matmul_tflops)
        if self.launch_us is not None and (not isinstance(self.launch_us, (int, float)) or self.launch_us < 0):
            raise ValueError(f"launch_us must be >= 0, got {self.launch_us!r}")

    # the time model's vocabulary (traffic.estimate_time)
    @property
    def name(self) -> str:
        return self.gpu

    @property
    def hbm_gbps(self) -> float:
        return self.copy_gbps

    @property
    def peak_tflops(self) -> float:
        return self.matmul_tflops

    @property
    def ridge(self) -> float:
        """FLOP per byte where the roofline turns from memory- to compute-bound."""
        return ridge_point(self.matmul_tflops, self.copy_gbps)

    def attainable_tflops(self, intensity: float) -> float:
        return attainable_tflops(intensity, self.matmul_tflops, self.copy_gbps)

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


__all__ = ["Ceilings", "ridge_point", "roofline_seconds", "attainable_tflops"]
