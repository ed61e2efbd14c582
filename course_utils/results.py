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



__all__ = ["RESULTS", "topic", "provenance", "provenance_line", "gpu_slug", "recorded_gpus", "recorded", "save",
           "Target"]
