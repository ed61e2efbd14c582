"""What one eager launch costs the host, read from the recorded measurements in ``results/``.

Launch cost belongs to the host (its CPU, the driver, Python and PyTorch's dispatcher), not to the
GPU: the same torch op costs 17.8 us per call back to back on the host of the lent H100 and 9.4 us
on the host of the lent H200 (``results/*/launch_overhead.csv``, chapter 1). The time model uses
the recorded figure of the course's reference machine (the first folder of ``results/``, H100
first), named in :data:`LAUNCH_OVERHEAD_SOURCE`; :data:`LAUNCH_OVERHEAD_FALLBACK_US` is used only
when no recording can be read (a copy of the package without ``results/``).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "results"

#: Used only when no ``launch_overhead.csv`` can be read: a round figure between the two recorded
#: hosts' 9.4 and 17.8 us (see the module docstring); :func:`launch_overhead` says when it is used.
LAUNCH_OVERHEAD_FALLBACK_US = 10.0

#: The row of ``benchmarks/launch_overhead.py`` that is "one eager launch": ``torch.relu`` on one
#: element, called back to back, host clock (the rate the host sustains, what a chain of tiny
#: kernels pays).
_CASE, _IMPL, _METHOD = "tiny op", "torch.relu(x)", "host clock"


@dataclass(frozen=True)
class LaunchOverhead:
    """Microseconds per eager launch and where the figure comes from."""

    us: float
    gpu: str          # the GPU of the machine whose host was measured ("" for the fallback)
    source: str       # the CSV it was read from, or why the fallback is used
    torch: str = ""
    date: str = ""

    def describe(self) -> str:
        if not self.gpu:
            return f"{self.us:g} us per launch (fallback constant: {self.source})"
        return (f"{self.us:.1f} us per eager launch, measured on the host of the lent {self.gpu} machine "
                f"(torch {self.torch}, {self.date}; {self.source})")


def _folders(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    dirs = sorted(p for p in root.iterdir() if (p / "launch_overhead.csv").is_file())
    return sorted(dirs, key=lambda p: (not p.name.startswith("h100"), p.name))


def launch_overhead(gpu: str | None = None, root: Path | None = None) -> LaunchOverhead:
    """The recorded cost of one eager launch: ``results/<gpu>/launch_overhead.csv`` (``gpu`` a
    results folder such as ``"h200"``; None: the first folder, H100 first).

    Falls back to :data:`LAUNCH_OVERHEAD_FALLBACK_US` with the reason when nothing can be read;
    raises ``ValueError`` when a named folder has no such recording.
    """
    root = RESULTS if root is None else Path(root)
    folders = [root / gpu] if gpu else _folders(root)
    for folder in folders:
        path = folder / "launch_overhead.csv"
        if not path.is_file():
            raise ValueError(f"gpu: no recorded launch overhead at {path}")
        with path.open(newline="") as f:
            for r in csv.DictReader(f):
                if (r.get("case"), r.get("impl"), r.get("method")) == (_CASE, _IMPL, _METHOD):
                    rel = path.relative_to(root.parent) if root.parent in path.parents else path
                    return LaunchOverhead(float(r["us_per_op"]), r.get("gpu", folder.name), str(rel),
                                          r.get("torch", ""), r.get("date", ""))
        if gpu:
            raise ValueError(f"gpu: {path} has no row {_CASE!r} / {_IMPL!r} / {_METHOD!r}")
    return LaunchOverhead(LAUNCH_OVERHEAD_FALLBACK_US, "", f"no launch_overhead.csv under {root}")


_RECORDED = launch_overhead()
#: Host-side cost of one eager launch, microseconds, as the time model uses it by default:
#: the recorded figure (see :data:`LAUNCH_OVERHEAD_SOURCE`), or the fallback constant.
LAUNCH_OVERHEAD_US = _RECORDED.us
#: Where :data:`LAUNCH_OVERHEAD_US` comes from, in one sentence naming the host's machine.
LAUNCH_OVERHEAD_SOURCE = _RECORDED.describe()

__all__ = ["LAUNCH_OVERHEAD_US", "LAUNCH_OVERHEAD_SOURCE", "LAUNCH_OVERHEAD_FALLBACK_US", "LaunchOverhead",
           "launch_overhead"]
