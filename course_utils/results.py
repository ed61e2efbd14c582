"""Recorded results and speed targets: ``results/<gpu>/<name>.csv`` with provenance.

Under the interpreter nothing is timed: :func:`recorded` returns what a real GPU measured. Every
CSV written by :func:`save` carries ``gpu``, ``torch``, ``triton`` and ``date`` columns
(:func:`provenance`); :func:`gpu_slug` names the folder; :class:`Target` is one speed target of a
chapter issue as ``make bench`` judges it.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass
from pathlib import Path

from . import env

RESULTS = Path(__file__).resolve().parent.parent / "results"


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


#: A side of a comparison "runs at the ceiling" from this fraction of a measured ceiling on (the copy
#: bandwidth or the matmul rate of ``ceilings.csv``, as the row's ``pct_of_copy`` / ``pct_of_matmul``).
TIE_CEILING_FRACTION = 0.9
#: ``Target.status`` of a target short of its ratio only by a tie at the ceiling (see :class:`Target`).
TIE = "tie at ceiling"
#: ``Target.status`` of a ratio above the most its measurement can honestly give (see :class:`Target`).
SUSPECT = "suspect"


def ceiling_fraction(row) -> float:
    """The fraction of a measured ceiling one results row reaches: the larger of its ``pct_of_copy``
    and ``pct_of_matmul`` over 100 (NaN when it has neither)."""
    pcts = [float(row[c]) for c in ("pct_of_copy", "pct_of_matmul") if c in row and row[c] == row[c]]
    return max(pcts) / 100 if pcts else float("nan")


def ratio_noise(ours, theirs) -> tuple[float, float]:
    """The interval the speed ratio theirs.ms / ours.ms spans within both sides' measured spread.

    Each row's ``ms_p20`` and ``ms_p80`` are the 20th and 80th percentiles of the repetitions of
    its median interleaved round (``bench.time_rounds``). The ratio's low end pairs their fastest
    with our slowest, the high end the other way round:
        low = theirs.ms_p20 / ours.ms_p80,   high = theirs.ms_p80 / ours.ms_p20
    so the interval contains 1.0 exactly when the two p20-p80 ranges overlap. NaN when a row
    has no percentiles (a wall-clock timing).
    """
    def get(row, col):
        return float(row[col]) if col in row else float("nan")

    return get(theirs, "ms_p20") / get(ours, "ms_p80"), get(theirs, "ms_p80") / get(ours, "ms_p20")


def tie_evidence(ours, theirs) -> dict:
    """``noise=`` and ``ceiling=`` for a :class:`Target` racing the results row ``ours`` against
    ``theirs``: what decides a tie at the ceiling (missing columns give NaN: never a tie)."""
    return {"noise": ratio_noise(ours, theirs), "ceiling": (ceiling_fraction(ours), ceiling_fraction(theirs))}


@dataclass(frozen=True)
class Target:
    """One speed target of a chapter issue, as ``make bench`` judges it.

    ``measured`` and ``required`` are ratios measured in one run on one GPU (ours / theirs).
    ``noise`` (the ratio's interval from both sides' p20/p80, :func:`ratio_noise`) and ``ceiling``
    (the fraction of a measured ceiling each side reaches, ours then theirs) are given for a race
    between two timed implementations (:meth:`between`, or ``**tie_evidence(ours, theirs)``); they
    decide a tie.

    Status: ``pass`` when measured >= required. Otherwise a *tie at the ceiling* when the ratio is
    1.0 within the run's noise (``noise`` contains 1.0) and both sides reach at least
    :data:`TIE_CEILING_FRACTION` of a measured ceiling: two kernels that both run at the hardware's
    limit cannot beat each other by more than the noise, whatever the target asked. Else ``short``:
    a loss, or a ratio within noise of 1.0 while off the ceiling (there is room left to win).

    ``most``: the largest ratio the measurement can honestly give (a per-GPU throughput against one GPU
    at the same work per GPU cannot exceed 1.0 but by noise). Above it the status is :data:`SUSPECT`,
    never a pass: the baseline ran slower than what it bounds, and the run must be repeated.
    """

    issue: int
    claim: str      # e.g. "gelu bf16 256 MiB vs copy_ bandwidth"
    measured: float
    required: float
    noise: tuple[float, float] | None = None
    ceiling: tuple[float, float] | None = None
    most: float | None = None

    @classmethod
    def between(cls, issue: int, claim: str, ours, theirs, required: float) -> Target:
        """The target "ours at least ``required`` times as fast as theirs" from the two results rows
        (mappings with ``ms``, ``ms_p20``, ``ms_p80`` and ``pct_of_copy`` and/or ``pct_of_matmul``)."""
        return cls(issue, claim, float(theirs["ms"]) / float(ours["ms"]), required, **tie_evidence(ours, theirs))

    @property
    def suspect(self) -> bool:
        """Above ``most``: a ratio the measurement cannot honestly give (see the class's docstring)."""
        return self.most is not None and self.measured > self.most

    @property
    def passed(self) -> bool:
        return self.measured >= self.required and not self.suspect

    @property
    def tied(self) -> bool:
        """Short of ``required``, but a tie at the ceiling (see the class's docstring)."""
        if self.passed or self.suspect or self.noise is None or self.ceiling is None:
            return False
        low, high = self.noise
        return low <= 1.0 <= high and all(c >= TIE_CEILING_FRACTION for c in self.ceiling)  # NaN: never

    @property
    def status(self) -> str:
        return SUSPECT if self.suspect else "pass" if self.passed else TIE if self.tied else "short"

    def row(self) -> dict:
        noise = f"{self.noise[0]:.3f}-{self.noise[1]:.3f}" if self.noise and all(
            v == v for v in self.noise) else ""
        ceiling = " / ".join(f"{100 * c:.0f}%" if c == c else "-" for c in self.ceiling) if self.ceiling else ""
        return {"issue": self.issue, "target": self.claim, "required": self.required,
                "measured": round(self.measured, 3), "status": self.status, "noise": noise,
                "at_ceiling": ceiling}


__all__ = ["RESULTS", "topic", "provenance", "provenance_line", "gpu_slug", "recorded_gpus", "recorded", "save",
           "Target", "TIE", "SUSPECT", "TIE_CEILING_FRACTION", "ceiling_fraction", "ratio_noise",
           "tie_evidence"]
