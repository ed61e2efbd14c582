"""The ceilings of the GPU in hand and the roofline plot.

- :func:`measure_ceilings`: copy bandwidth and matmul rate measured on the GPU in hand (with its L2).
- :func:`ceilings_for`: the measured ceilings when given, else the datasheet's, with a note saying which.
- :func:`with_ceilings`: each sweep row's % of them; :func:`roofline_frame` and
  :func:`plot_roofline`: kernels placed on the roofline of :mod:`course_utils.ceilings`.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from . import env, hardware
from .ceilings import Ceilings, attainable_tflops


def measure_ceilings(copy_bytes: int = 2**30, matmul_n: int = 8192) -> Ceilings:
    """Measure the copy bandwidth and the matmul rate of the GPU in hand (about 2 s on an H100)."""
    if not env.on_gpu():
        raise RuntimeError("measure_ceilings needs a GPU; under the interpreter read recorded('ceilings')")
    dtype = torch.bfloat16 if torch.bfloat16 in env.supported_dtypes() else torch.float16
    c = ceilings_for(env.device_name(), hardware.measure_copy_gbps(copy_bytes),
                     hardware.measure_matmul_tflops(matmul_n, dtype), str(dtype).removeprefix("torch."))
    l2 = hardware.device_properties()["l2_bytes"]
    return dataclasses.replace(c, l2_bytes=int(l2)) if l2 else c


def ceilings_for(gpu: str, copy_gbps: float | None = None, matmul_tflops: float | None = None,
                 matmul_dtype: str = "bfloat16") -> Ceilings:
    """Ceilings for ``gpu``: the measured ones when given, else the datasheet's, with a note saying which.

    A GPU missing from the hardware table is fine when both ceilings were measured (the note says
    so); without measurements there is nothing to fall back on and this raises ``ValueError``.
    """
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
        return Ceilings(gpu, float(copy_gbps), float(matmul_tflops), matmul_dtype, "measured", note,
                        spec.l2_bytes if spec else 0)
    if spec is None:
        raise ValueError(f"{gpu!r} is not in the hardware table and no ceilings were measured: "
                         "measure them on the GPU (bench.measure_ceilings()) and pass them in")
    dt = matmul_dtype if matmul_dtype in spec.tflops else "float16"
    return Ceilings(gpu, copy_gbps or spec.hbm_gbps, matmul_tflops or spec.tflops[dt], dt, "datasheet",
                    "datasheet peaks (nothing measured): real kernels reach less; measure on the GPU",
                    spec.l2_bytes)


def with_ceilings(df, ceilings: Ceilings):
    """Add ``pct_of_copy`` (GB/s rows) and ``pct_of_matmul`` (TFLOP/s rows) to a sweep's DataFrame."""
    df = df.copy()
    if "gbps" in df.columns:
        df["pct_of_copy"] = 100 * df["gbps"] / ceilings.copy_gbps
    if "tflops" in df.columns:
        df["pct_of_matmul"] = 100 * df["tflops"] / ceilings.matmul_tflops
    return df



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
    df["attainable_tflops"] = [ceilings.attainable_tflops(float(i)) for i in df["intensity"]]
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
    ax.loglog(xs, [ceilings.attainable_tflops(float(x)) for x in xs],
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



__all__ = ["Ceilings", "measure_ceilings", "ceilings_for", "with_ceilings", "attainable_tflops", "roofline_frame",
           "plot_roofline"]
