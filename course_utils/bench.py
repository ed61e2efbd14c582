"""The one benchmark harness of the course.

Protocol (chapter 8 shows each rule measured the wrong way and the right way): warm up first
(compilation, autotuning, caches), time on the device with CUDA events, flush L2 between
repetitions, report the median with the 20th and 80th percentiles, and replay a CUDA graph for
launch-bound sizes when asked to. Under the interpreter nothing is timed: :func:`recorded` returns
what a real GPU measured, from ``results/<gpu>/<name>.csv``.
"""

from __future__ import annotations

import datetime as _dt
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from . import env

RESULTS = Path(__file__).resolve().parent.parent / "results"
L2_FLUSH_BYTES = 256 * 2**20  # larger than the L2 of any GPU in the hardware table


@dataclass(frozen=True)
class Timing:
    """Milliseconds per call: median and the 20th/80th percentiles of the repetitions."""

    median: float
    p20: float
    p80: float
    reps: int
    cuda_graph: bool = False

    @property
    def us(self) -> float:
        return self.median * 1e3


def _quantile(sorted_xs, q):
    return statistics.quantiles(sorted_xs, n=100, method="inclusive")[int(q * 100) - 1] \
        if len(sorted_xs) > 1 else sorted_xs[0]


def time_ms(fn, *, warmup: int = 10, rep: int = 50, flush_l2: bool = True, cuda_graph: bool = False) -> Timing:
    """Time ``fn()`` on the GPU by the course's protocol and return a :class:`Timing`.

    ``cuda_graph=True`` captures ``fn`` once in a CUDA graph and times replays, which removes the
    host's launch overhead (for launch-bound sizes; say so when you report it).
    """
    if not env.on_gpu():
        raise RuntimeError("bench.time_ms times a real GPU; under the interpreter use bench.recorded(name)")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    run = fn
    if cuda_graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm-up on the capture stream
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    flush = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda") if flush_l2 else None
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    for i in range(rep):
        if flush is not None:
            flush.zero_()
        starts[i].record()
        run()
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return Timing(statistics.median(times), _quantile(times, 0.2), _quantile(times, 0.8), rep, cuda_graph)


def gbps(nbytes: int, t: Timing | float) -> float:
    """GB/s (1e9 bytes per second) for ``nbytes`` moved in ``t`` (a Timing or milliseconds)."""
    ms = t.median if isinstance(t, Timing) else t
    return nbytes / (ms * 1e-3) / 1e9


def tflops(flops: float, t: Timing | float) -> float:
    ms = t.median if isinstance(t, Timing) else t
    return flops / (ms * 1e-3) / 1e12


def provenance() -> dict:
    """Where a measurement comes from: GPU, versions and date."""
    v = env.versions()
    return {"gpu": env.device_name(), "torch": v["torch"], "triton": v["triton"],
            "date": _dt.date.today().isoformat()}


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


def save(df, name: str, gpu: str | None = None) -> Path:
    """Write a results DataFrame to ``results/<gpu>/<name>.csv`` with provenance columns."""
    slug = gpu or gpu_slug()
    path = RESULTS / slug / f"{name}.csv"
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
