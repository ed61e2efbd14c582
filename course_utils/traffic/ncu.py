"""The cases measured with Nsight Compute (``benchmarks/ncu_traffic.py``) and the comparison of
the calculator's bytes with the DRAM bytes the counters saw (``results/<gpu>/dram_traffic.csv``)."""

from __future__ import annotations

from collections.abc import Iterable

from .model import Op, Traffic
from .ops import elementwise_chain, softmax
from .timemodel import dram_bytes_cold, l2_hit_fraction

#: ``relu((x + bias) * s) + r`` as benchmarks/ncu_traffic.py runs it: a bias per column, a scalar,
#: a unary op and a second full tensor.
NCU_CHAIN_OPS = (Op("add bias", ("col",)), Op("mul s", ("scalar",)), Op("relu"), Op("add r", ("full",)))


def ncu_case(case: str, rows: int, cols: int, dtype: str) -> Traffic:
    """The calculator's kernels for one case of benchmarks/ncu_traffic.py."""
    cases = {"chain-eager": lambda: elementwise_chain(NCU_CHAIN_OPS, (rows, cols), dtype).unfused,
             "chain-fused": lambda: elementwise_chain(NCU_CHAIN_OPS, (rows, cols), dtype).fused,
             "softmax-eager": lambda: softmax(rows, cols, dtype).unfused,
             "softmax-fused": lambda: softmax(rows, cols, dtype).fused}
    if case not in cases:
        raise ValueError(f"case must be one of {sorted(cases)}, got {case!r}")
    return cases[case]()


def compare_with_ncu(rows: Iterable[dict]) -> list[dict]:
    """Predicted vs measured DRAM bytes, one row per (cache mode, case, size).

    ``rows``: the per-kernel records of ``results/<gpu>/dram_traffic.csv`` (e.g.
    ``df.to_dict("records")``). Each output row has the logical bytes, the cold-L2 estimate of
    :func:`dram_bytes_cold` (for ``--cache-control all``), the reads left once L2 reuse between
    kernels is taken off (:func:`l2_hit_fraction`, for ``--cache-control none``) and the measured bytes.
    """
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["cache_control"], r["case"], float(r["factor"])), []).append(r)
    out = []
    for (mode, case, factor), recs in groups.items():
        first = recs[0]
        traffic = ncu_case(case, int(first["rows"]), int(first["cols"]), first["dtype"])
        l2 = int(first["l2_bytes"])
        cold = [dram_bytes_cold(k, l2) for k in traffic.kernels]
        hits = [0.0] + [k.reuse_bytes * l2_hit_fraction(p.total_bytes, l2)
                        for p, k in zip(traffic.kernels, traffic.kernels[1:])]
        out.append({
            "cache_control": mode, "case": case, "factor": factor, "l2_bytes": l2,
            "kernels": len(recs), "predicted_kernels": traffic.launches,
            "logical_read": traffic.read_bytes, "logical_write": traffic.write_bytes,
            "logical_total": traffic.total_bytes,
            "cold_read": sum(c[0] for c in cold), "cold_write": sum(c[1] for c in cold),
            "warm_read": traffic.read_bytes - sum(hits),
            "measured_read": sum(int(r["dram_read_bytes"]) for r in recs),
            "measured_write": sum(int(r["dram_write_bytes"]) for r in recs),
        })
        o = out[-1]
        o["cold_total"] = o["cold_read"] + o["cold_write"]
        o["measured_total"] = o["measured_read"] + o["measured_write"]
        o["measured_over_logical"] = o["measured_total"] / o["logical_total"]
    return out


__all__ = ["NCU_CHAIN_OPS", "ncu_case", "compare_with_ncu"]
