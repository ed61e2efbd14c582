"""Sweeps: implementations x cases -> one DataFrame, outputs checked before anything is timed.

- :func:`sweep` times implementations over a list of cases and returns a pandas DataFrame with
  ``ms``, ``ms_p20``, ``ms_p80`` (:data:`course_utils.timing.TIMING_COLUMNS`) and GB/s or TFLOP/s;
  a callable that raises, returns nothing or changes its answer between calls is reported, not timed.
- :func:`verify_callable` is that check; :func:`sizes` a geometric range; :func:`plot_sweep` one
  line per implementation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

import torch

from .timing import BenchmarkError, _name, gbps, tflops, time_ms


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
        row.update(**t.columns(), reps=t.reps, cuda_graph=t.cuda_graph)
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



__all__ = ["verify_callable", "sweep", "sizes", "plot_sweep"]
