"""DRAM bytes measured with Nsight Compute, to check the traffic calculator of chapter 2.

Four cases, each at several tensor sizes given as multiples of the GPU's L2 size:

    chain-eager    relu((x + bias) * s) + r as four eager torch kernels (bf16, bias per column)
    chain-fused    the same chain in one small Triton kernel defined below
    softmax-eager  softmax along rows as five eager torch ops: amax, sub, exp, sum, div (fp32)
    softmax-fused  one Triton program per row: read the row once, write it once (fp32)

The fused kernels live here on purpose: this script tests the calculator, not the course's kernels.

    python benchmarks/ncu_traffic.py case chain-eager --factor 4   # run one case (no profiler)
    python benchmarks/ncu_traffic.py case all --factors 0.5,4      # what ncu profiles
    python benchmarks/ncu_traffic.py ncu --out results.csv          # the driver: runs ncu, writes CSV
    python benchmarks/ncu_traffic.py timing --out timing.csv        # eager vs fused chains of 1..8 ops

``make bench`` runs :func:`sweep` (the timings, no ncu) with :func:`targets`.

The driver runs ``ncu --clock-control none --cache-control <all|none> --profile-from-start off
--metrics dram__bytes_read.sum,dram__bytes_write.sum --csv`` on ``case all``. Only kernels between
``torch.cuda.profiler.start()`` and ``stop()`` are profiled (the set-up kernels are not), so the
rows come back in the order of :data:`CASES`, kernel by kernel. With ``--cache-control all`` (ncu's
default) every kernel starts with a cold, flushed L2: what each kernel reads or writes in DRAM on
its own. With ``none`` the L2 keeps what the previous kernel left there, as in a real program.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys
import time

CASES = ("chain-eager", "chain-fused", "softmax-eager", "softmax-fused")
# Kernels each case launches, in order; the driver checks the count against ncu's rows.
KERNELS = {"chain-eager": 4, "chain-fused": 1, "softmax-eager": 5, "softmax-fused": 1}
DTYPES = {"chain-eager": "bfloat16", "chain-fused": "bfloat16",
          "softmax-eager": "float32", "softmax-fused": "float32"}
COLS = 4096            # row length of every case
DEFAULT_FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
METRICS = "dram__bytes_read.sum,dram__bytes_write.sum"


def _triton_kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def _chain_fused_kernel(x_ptr, bias_ptr, r_ptr, y_ptr, s, n_elements, n_cols,
                            BLOCK_SIZE: tl.constexpr):
        pid = tl.program_id(0)
        offsets = pid.to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        mask = offsets < n_elements
        x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
        b = tl.load(bias_ptr + offsets % n_cols, mask=mask).to(tl.float32)
        r = tl.load(r_ptr + offsets, mask=mask).to(tl.float32)
        y = tl.maximum((x + b) * s, 0.0) + r
        tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)

    # A bare one-row-per-program softmax, kept here on purpose: it is the kernel the recorded ncu
    # bytes (results/*/dram_traffic.csv) were measured on. The course's tuned versions, whose
    # choices change with tuning, live in course_utils/kernels/softmax.py.
    @triton.jit
    def _softmax_fused_kernel(x_ptr, y_ptr, n_cols, row_stride, BLOCK_SIZE: tl.constexpr):
        pid = tl.program_id(0)
        offsets = tl.arange(0, BLOCK_SIZE)
        mask = offsets < n_cols
        row = pid.to(tl.int64) * row_stride
        x = tl.load(x_ptr + row + offsets, mask=mask, other=-float("inf")).to(tl.float32)
        x = x - tl.max(x, axis=0)
        e = tl.exp(x)
        y = e / tl.sum(e, axis=0)
        tl.store(y_ptr + row + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)

    return triton, _chain_fused_kernel, _softmax_fused_kernel


def l2_bytes() -> int:
    import torch
    return int(torch.cuda.get_device_properties(0).L2_cache_size)


def shape_for(case: str, factor: float, l2: int) -> tuple[int, int]:
    """(rows, COLS) such that one tensor of the case holds about ``factor`` x L2 bytes."""
    itemsize = 2 if DTYPES[case] == "bfloat16" else 4
    rows = max(1, round(factor * l2 / (itemsize * COLS)))
    return rows, COLS


def make_case(case: str, factor: float, l2: int):
    """A zero-argument callable that runs the case once, and its shape."""
    import torch
    triton, chain_kernel, softmax_kernel = _triton_kernels()
    rows, cols = shape_for(case, factor, l2)
    dtype = getattr(torch, DTYPES[case])
    x = torch.randn(rows, cols, device="cuda", dtype=dtype)
    if case.startswith("chain"):
        bias = torch.randn(cols, device="cuda", dtype=dtype)
        r = torch.randn(rows, cols, device="cuda", dtype=dtype)
        s = 0.5
        if case == "chain-eager":
            def run():
                return torch.relu((x + bias) * s) + r
        else:
            y = torch.empty_like(x)
            n = x.numel()
            grid = (triton.cdiv(n, 1024),)

            def run():
                chain_kernel[grid](x, bias, r, y, s, n, cols, BLOCK_SIZE=1024)
                return y
        ref = torch.relu((x.float() + bias.float()) * s) + r.float()
    else:
        if case == "softmax-eager":
            def run():
                m = x.amax(dim=1, keepdim=True)
                z = x - m
                e = torch.exp(z)
                s_ = e.sum(dim=1, keepdim=True)
                return e / s_
        else:
            y = torch.empty_like(x)

            def run():
                softmax_kernel[(rows,)](x, y, cols, x.stride(0), BLOCK_SIZE=triton.next_power_of_2(cols),
                                        num_warps=8)
                return y
        ref = torch.softmax(x.double(), dim=1)
    out = run()  # warm-up: compiles the Triton kernels outside the profiled range
    torch.cuda.synchronize()
    err = (out.double() - ref.double()).abs().max().item()
    tol = 0.05 if dtype == torch.bfloat16 else 1e-5
    if not err <= tol:
        raise RuntimeError(f"{case}: result differs from the reference by {err}")
    return run, (rows, cols)


def run_cases(cases, factors, manifest_path: str | None) -> list[dict]:
    import torch
    l2 = l2_bytes()
    # Reading a buffer of 4x L2 that nothing writes evicts whatever the set-up left dirty in L2,
    # so no case pays for writing back another's data (it matters with --cache-control none).
    flush = torch.ones(l2, dtype=torch.int32, device="cuda")
    manifest = []
    for factor in factors:
        for case in cases:
            run, (rows, cols) = make_case(case, factor, l2)
            flush.sum()                # leave the L2 full of clean data that no case reads
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            run()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            manifest.append({"case": case, "factor": factor, "rows": rows, "cols": cols,
                             "dtype": DTYPES[case], "kernels": KERNELS[case], "l2_bytes": l2})
            del run
            torch.cuda.empty_cache()
    if manifest_path:
        with open(manifest_path, "w") as f:
            json.dump(manifest, f)
    return manifest


def parse_ncu_csv(text: str) -> list[dict]:
    """ncu --csv rows -> [{id, kernel, dram_read_bytes, dram_write_bytes}] in launch order."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    kernels: dict[int, dict] = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines))):
        kid = int(row["ID"])
        k = kernels.setdefault(kid, {"id": kid, "kernel": row["Kernel Name"]})
        value = float(row["Metric Value"].replace(",", ""))
        scale = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9}
        value *= scale.get(row.get("Metric Unit", "byte"), 1)
        if row["Metric Name"] == "dram__bytes_read.sum":
            k["dram_read_bytes"] = int(round(value))
        elif row["Metric Name"] == "dram__bytes_write.sum":
            k["dram_write_bytes"] = int(round(value))
    return [kernels[k] for k in sorted(kernels)]


def driver(out_csv: str, factors, cache_modes, timeout: int) -> None:
    import torch

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import glob

    from course_utils import bench
    ncu = shutil.which("ncu") or next(iter(sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"))
                                           + ["/usr/local/cuda/bin/ncu"]))
    prov = bench.provenance()
    prov["gpu"] = torch.cuda.get_device_name(0)
    rows_out = []
    for mode in cache_modes:
        manifest = f"/tmp/ncu_manifest_{mode}.json"
        log = f"/tmp/ncu_{mode}.csv"
        cmd = [ncu, "--clock-control", "none", "--cache-control", mode, "--profile-from-start", "off",
               "--metrics", METRICS, "--csv", "--print-units", "base", "--log-file", log,
               sys.executable, os.path.abspath(__file__), "case", "all",
               "--factors", ",".join(str(f) for f in factors), "--manifest", manifest]
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        print(f"ncu cache-control={mode}: exit {proc.returncode} in {time.time() - t0:.0f} s", flush=True)
        if proc.returncode != 0:
            print(proc.stdout[-3000:], proc.stderr[-3000:], flush=True)
            continue
        kernels = parse_ncu_csv(open(log).read())
        cases = json.load(open(manifest))
        expected = sum(c["kernels"] for c in cases)
        if len(kernels) != expected:
            print(f"WARNING: ncu reported {len(kernels)} kernels, expected {expected}", flush=True)
        it = iter(kernels)
        for c in cases:
            for i in range(c["kernels"]):
                k = next(it, None)
                if k is None:
                    break
                rows_out.append({**{k2: c[k2] for k2 in ("case", "factor", "rows", "cols", "dtype", "l2_bytes")},
                                 "cache_control": mode, "kernel_index": i, "kernel": k["kernel"][:60],
                                 "dram_read_bytes": k.get("dram_read_bytes"),
                                 "dram_write_bytes": k.get("dram_write_bytes"), **prov})
        with open(out_csv, "w", newline="") as f:  # written after each mode: partial results survive
            w = csv.DictWriter(f, fieldnames=list(rows_out[0]))
            w.writeheader()
            w.writerows(rows_out)
    print(f"wrote {len(rows_out)} rows to {out_csv}")
    totals: dict = {}
    for r in rows_out:
        key = (r["cache_control"], r["case"], r["factor"])
        t = totals.setdefault(key, [0, 0, 0])
        t[0] += r["dram_read_bytes"] or 0
        t[1] += r["dram_write_bytes"] or 0
        t[2] += 1
    print(f"{'cache':>5} {'case':>14} {'xL2':>5} {'kernels':>7} {'read MB':>9} {'write MB':>9}")
    for (mode, case, factor), (rd, wr, nk) in totals.items():
        print(f"{mode:>5} {case:>14} {factor:>5} {nk:>7} {rd / 1e6:9.1f} {wr / 1e6:9.1f}")


def chain_timings(max_ops: int = 8, quick: bool = False) -> list[dict]:
    """Time a chain of k scalar ops (alternating * and +), eager vs one Triton kernel, k = 1..max_ops.

    Sizes: 256 MiB bf16 (well above L2), L2/2 (fits in L2) and 64 KiB (launch-bound); ``quick``
    keeps 256 MiB and k in (1, 4, 8). Times come from the course's harness (L2 flushed between
    repetitions, median of 50); ``gbps`` counts the logical traffic of ``course_utils.traffic``.
    """
    import torch
    import triton
    import triton.language as tl

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from course_utils import bench
    from course_utils import traffic as T

    @triton.jit
    def _chain_k_kernel(x_ptr, y_ptr, n_elements, N_OPS: tl.constexpr, BLOCK_SIZE: tl.constexpr):
        pid = tl.program_id(0)
        offsets = pid.to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        mask = offsets < n_elements
        y = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
        for i in tl.static_range(N_OPS):
            if i % 2 == 0:
                y = y * 1.0001
            else:
                y = y + 0.5
        tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)

    def eager(x, k):
        y = x
        for i in range(k):
            y = y * 1.0001 if i % 2 == 0 else y + 0.5
        return y

    l2 = l2_bytes()
    sizes = (("256MiB", 256 * 2**20), ("L2/2", l2 // 2), ("64KiB", 64 * 2**10))
    ks = (1, 4, max_ops) if quick else range(1, max_ops + 1)
    rows = []
    for label, nbytes in sizes[:1] if quick else sizes:
        x = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
        y = torch.empty_like(x)
        n = x.numel()
        grid = (triton.cdiv(n, 1024),)
        for k in ks:
            fused = lambda: _chain_k_kernel[grid](x, y, n, N_OPS=k, BLOCK_SIZE=1024)  # noqa: E731
            fused()
            torch.testing.assert_close(y.float(), eager(x, k).float(), rtol=2e-2, atol=2e-2)
            comp = T.elementwise_chain(k, n, "bf16")
            # eager and fused in interleaved rounds, the median round kept (bench.time_rounds)
            timed = bench.time_rounds({"eager": lambda: eager(x, k), "fused": fused}, rep=50)  # noqa: B023
            for impl, traffic in (("eager", comp.unfused), ("fused", comp.fused)):
                t = timed[impl]
                rows.append({"size": label, "tensor_bytes": nbytes, "dtype": "bfloat16", "ops": k,
                             "impl": impl, "kernels": traffic.launches, **t.columns(), "bytes": traffic.total_bytes,
                             "gbps": bench.gbps(traffic.total_bytes, t), "l2_bytes": l2})
    return rows


TITLE = "Fusion accounting: a chain of k elementwise ops, eager vs one Triton kernel"


def sweep(quick: bool = False):
    """``make bench``: the chain timings as a DataFrame (one row per size, k and implementation)."""
    import pandas as pd
    return pd.DataFrame(chain_timings(quick=quick))


def targets(df) -> list:
    """Issue 3's claim in time: fusing 8 ops on 256 MiB gains at least 90% of the traffic ratio 8."""
    from course_utils import bench
    g = df[(df["size"] == "256MiB") & (df["ops"] == df["ops"].max())]
    if g.empty:
        return []
    k = int(g["ops"].iloc[0])
    eager = float(g[g["impl"] == "eager"]["ms"].iloc[0])
    fused = float(g[g["impl"] == "fused"]["ms"].iloc[0])
    return [bench.Target(3, f"{k}-op bf16 chain on 256 MiB: (eager / fused time) / traffic ratio {k}",
                         eager / fused / k, 0.9)]


def timing(out_csv: str, max_ops: int = 8) -> None:
    """Write :func:`chain_timings` with provenance to ``out_csv`` and print a few rows."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from course_utils import bench

    rows = chain_timings(max_ops)
    prov = bench.provenance()
    with open(out_csv, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[*rows[0], *prov])
        w.writeheader()
        w.writerows({**r, **prov} for r in rows)
    for r in rows:
        if r["ops"] in (1, 4, 8):
            print(f"{r['size']:>7} k={r['ops']} {r['impl']:>5}: {r['ms'] * 1e3:9.1f} us")
    print(f"wrote {len(rows)} rows to {out_csv}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("case", help="run one case (or all) once, between profiler start/stop")
    c.add_argument("case", choices=[*CASES, "all"])
    c.add_argument("--factor", type=float, default=None, help="tensor size in multiples of L2")
    c.add_argument("--factors", default=None, help="comma-separated list of factors")
    c.add_argument("--manifest", default=None)
    d = sub.add_parser("ncu", help="run ncu over every case and write the CSV")
    d.add_argument("--out", required=True)
    d.add_argument("--factors", default=",".join(str(f) for f in DEFAULT_FACTORS))
    d.add_argument("--cache-modes", default="all,none")
    d.add_argument("--timeout", type=int, default=100)
    t = sub.add_parser("timing", help="time eager vs fused chains of 1..8 ops (no ncu)")
    t.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.cmd == "case":
        factors = ([args.factor] if args.factor is not None else
                   [float(f) for f in (args.factors or "4").split(",")])
        cases = CASES if args.case == "all" else (args.case,)
        run_cases(cases, factors, args.manifest)
        return 0
    if args.cmd == "timing":
        timing(args.out)
        return 0
    driver(args.out, [float(f) for f in args.factors.split(",")], args.cache_modes.split(","), args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
