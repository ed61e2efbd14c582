"""Chapter 1 benchmark: what one kernel launch costs, and what a CUDA graph saves.

Rows (``us`` is microseconds per call of what ``impl`` names; ``us_per_op`` divides by ``n_ops``):
- ``relu size sweep``: ``torch.relu`` on 1 ... 2^28 float32 elements, timed two ways: ``host clock``
  (calls back to back, synchronize, divide: the rate the host sustains, what a model of many small
  kernels pays) and ``cuda events`` (the course's harness: the time the GPU spends, median);
- ``tiny op``: one-element ``relu``/``add``/``x.add_``, host clock, back to back;
- ``empty triton kernel``: a Triton kernel with no body, 1 and 10 tensor arguments, and a tiny
  Triton ``add_one``; host clock;
- ``chain``: N tiny ops (N = 10, 100, 500) eager (N launches) vs one CUDA graph replay, host clock
  per chain; and 100 tiny Triton launches eager vs graphed.

Chapter 1 has no speed targets (``targets`` returns []): it measures the cost the later chapters
remove. ``python -m benchmarks.launch_overhead`` also measures the copy and matmul ceilings and
writes ``results/<gpu>/launch_overhead.csv`` and ``results/<gpu>/ceilings.csv``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import pandas as pd
import torch

import course_utils as cu
from course_utils import bench, graphs
from course_utils.kernels import launch

TITLE = "Launch overhead and CUDA graphs"
CHAIN_LENGTHS = (10, 100, 500)


def _row(case, impl, method, us, n_ops=1, elements=1, nbytes=0):
    return {"case": case, "impl": impl, "method": method, "n_ops": n_ops, "elements": elements,
            "us": us, "us_per_op": us / n_ops, "gbps": (nbytes / (us * 1e-6) / 1e9) if nbytes else float("nan")}


def _graphed(fn):
    """Capture ``fn()`` once (course_utils.graphs: warm-up on a side stream, then capture); return
    the replay and fn's output."""
    g = graphs.capture(fn)
    return g.replay, g.output


def _host_calls(us_budget: float, quick: bool) -> int:
    """How many back-to-back calls to time: about 20 ms of work, at least 20."""
    return max(20, min(5000, int((5_000 if quick else 20_000) / max(us_budget, 1.0))))


def sweep(quick: bool = False) -> pd.DataFrame:
    if not cu.on_gpu():
        raise RuntimeError("benchmarks.launch_overhead measures a GPU; on the CPU read "
                           "bench.recorded('launch_overhead')")
    dev = "cuda"
    rows = []

    # 1. relu from one element to 1 GiB: a flat floor, then time grows with the bytes.
    sizes = [1, 2**10, 2**16, 2**20, 10_000_000, 2**24, 2**26, 2**28]
    if quick:
        sizes = [1, 2**16, 2**20, 10_000_000, 2**24]
    for n in sizes:
        x = torch.randn(n, device=dev)
        fn = lambda x=x: torch.relu(x)  # noqa: E731
        nbytes = 2 * n * 4
        t = bench.time_ms(fn, flush_l2=n * 4 < bench.L2_FLUSH_BYTES, rep=50 if not quick else 20)
        rows.append(_row("relu size sweep", "torch.relu", "cuda events", t.us, elements=n, nbytes=nbytes))
        us = launch.host_us_per_call(fn, calls=_host_calls(t.us, quick))
        rows.append(_row("relu size sweep", "torch.relu", "host clock", us, elements=n, nbytes=nbytes))
        del x

    # 2. Tiny torch ops, back to back.
    x1 = torch.randn(1, device=dev)
    y1 = torch.randn(1, device=dev)
    for impl, fn in [("torch.relu(x)", lambda: torch.relu(x1)), ("x + y", lambda: x1 + y1),
                     ("x.add_(1) in place", lambda: x1.add_(1.0))]:
        rows.append(_row("tiny op", impl, "host clock", launch.host_us_per_call(fn, calls=_host_calls(5, quick))))

    # 3. Triton kernels that do nothing: the launch path alone.
    args10 = [torch.empty(1, device=dev) for _ in range(10)]
    for impl, fn in [("empty kernel, 1 arg", lambda: launch.empty(x1)),
                     ("empty kernel, 10 args", lambda: launch.empty10(*args10)),
                     ("add_one, 1 element", lambda: launch.add_one(x1))]:
        rows.append(_row("empty triton kernel", impl, "host clock",
                         launch.host_us_per_call(fn, calls=_host_calls(10, quick))))

    # 4. Chains of tiny ops: N launches from the host, or one graph replay.
    for n_ops in (CHAIN_LENGTHS if not quick else (10, 100)):
        chain = lambda n_ops=n_ops: launch.chain_ref(x1, n_ops)  # noqa: E731
        calls = _host_calls(5 * n_ops, quick)
        eager = launch.host_us_per_call(chain, calls=calls)
        replay, out = _graphed(chain)
        replay()
        torch.testing.assert_close(out, chain())  # the graph computes what eager does
        graphed = launch.host_us_per_call(replay, calls=calls)
        rows.append(_row("chain", f"eager, {n_ops} launches", "host clock", eager, n_ops=n_ops))
        rows.append(_row("chain", "CUDA graph, 1 replay", "host clock", graphed, n_ops=n_ops))

    out1 = torch.empty_like(x1)

    def triton_chain(n_ops=100):
        for _ in range(n_ops):
            launch.add_one(x1, out=out1)

    calls = _host_calls(1000, quick)
    eager = launch.host_us_per_call(triton_chain, calls=calls)
    replay, _ = _graphed(triton_chain)
    rows.append(_row("triton chain", "eager, 100 launches", "host clock", eager, n_ops=100))
    rows.append(_row("triton chain", "CUDA graph, 1 replay", "host clock",
                     launch.host_us_per_call(replay, calls=calls), n_ops=100))
    return pd.DataFrame(rows)


def targets(df: pd.DataFrame) -> list:
    """Chapter 1 has no speed targets: it measures the cost that fusion and graphs remove."""
    return []


def ceilings() -> pd.DataFrame:
    """The copy and matmul ceilings of the GPU in hand, one row (the columns ``make bench`` writes)."""
    row = bench.measure_ceilings().row()
    if row["matmul_dtype"] == "bfloat16":
        row["matmul_bf16_tflops"] = row["matmul_tflops"]
    return pd.DataFrame([row])


def summary(df: pd.DataFrame) -> str:
    def pick(case, impl, method="host clock", n_ops=None, elements=None):
        sel = df[(df.case == case) & (df.impl == impl) & (df.method == method)]
        if n_ops is not None:
            sel = sel[sel.n_ops == n_ops]
        if elements is not None:
            sel = sel[sel.elements == elements]
        return float(sel.us.iloc[0])

    lines = [f"{'what':48s} {'us per call':>12s}"]
    for impl in ("torch.relu(x)", "x + y", "x.add_(1) in place"):
        lines.append(f"{'tiny op ' + impl:48s} {pick('tiny op', impl):12.2f}")
    for impl in ("empty kernel, 1 arg", "empty kernel, 10 args", "add_one, 1 element"):
        lines.append(f"{'triton ' + impl:48s} {pick('empty triton kernel', impl):12.2f}")
    for n in sorted(set(df[df.case == "chain"].n_ops)):
        e = pick("chain", f"eager, {n} launches", n_ops=n)
        g = pick("chain", "CUDA graph, 1 replay", n_ops=n)
        lines.append(f"{f'chain of {n}: eager / graph (x faster)':48s} {e:8.1f} / {g:.1f} ({e / g:.1f}x)")
    e = pick("triton chain", "eager, 100 launches")
    g = pick("triton chain", "CUDA graph, 1 replay")
    lines.append(f"{'100 triton add_one: eager / graph (x faster)':48s} {e:8.1f} / {g:.1f} ({e / g:.1f}x)")
    big = df[(df.case == "relu size sweep") & (df.method == "cuda events")].sort_values("elements").iloc[-1]
    lines.append(f"{f'relu {int(big.elements)} elements (events), GB/s':48s} {big.us:8.1f} us, {big.gbps:.0f} GB/s")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=TITLE)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--copy-to", help="also copy the CSVs written into this folder")
    args = ap.parse_args(argv)
    print(cu.banner(), flush=True)
    df = sweep(quick=args.quick)
    paths = [bench.save(df, "launch_overhead")]
    ceil = ceilings()
    paths.append(bench.save(ceil, "ceilings"))
    if args.copy_to:
        Path(args.copy_to).mkdir(parents=True, exist_ok=True)
        for p in paths:
            shutil.copy(p, Path(args.copy_to) / p.name)
    with pd.option_context("display.width", 160, "display.max_rows", 100):
        print(df.drop(columns=["case"]).to_string(index=False))
    print(f"ceilings: copy {ceil.copy_gbps[0]:.0f} GB/s, {ceil.matmul_dtype[0]} matmul "
          f"{ceil.matmul_tflops[0]:.0f} TFLOP/s ({ceil.note[0]})")
    print(summary(df))
    return 0


if __name__ == "__main__":
    sys.exit(main())
