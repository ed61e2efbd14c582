"""Softmax along rows (chapters 5 and 6): ours against torch.softmax, torch.compile and eager.

``sweep()`` times every implementation at each row length N with M rows chosen so that the input is
256 MiB, in fp32 and bf16, next to a device-to-device copy of the same bytes (the ceiling).
GB/s count the minimum traffic: one read of x and one write of y.

    python -m benchmarks.softmax sweep   [--out DIR]   # the sweep make bench runs, CSV + table
    python -m benchmarks.softmax tune    [--out DIR]   # candidate tiles/warps/grids, CSV
    python -m benchmarks.softmax limits  [--out DIR]   # registers, shared memory, occupancy, errors
    python -m benchmarks.softmax check                  # correctness on the GPU, every version
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import course_utils as cu
from course_utils import bench, hardware

TITLE = "Softmax along rows: fused, persistent, online and split versions"
INPUT_BYTES = 256 * 2**20
SHORT_N = (256, 1024, 4096, 16384)
LONG_N = (32768, 65536, 262144)
BETWEEN_N = (384, 1000, 3000, 6000, 12000, 17000, 20000, 26000, 50000, 100000, 200000)
JUDGED = ("ours", "torch.softmax", "copy")  # timed in interleaved rounds, the median round kept
ROUNDS = 3
DTYPES = (torch.float32, torch.bfloat16)


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def rows_for(n_cols: int, dtype: torch.dtype, nbytes: int = INPUT_BYTES) -> int:
    """M such that an M x N input of ``dtype`` is ``nbytes``."""
    return max(1, nbytes // (n_cols * dtype.itemsize))


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _time(fn, reps: int) -> bench.Timing:
    return bench.time_ms(fn, warmup=5, rep=reps)


def _row(n_cols, n_rows, dtype, impl, t: bench.Timing, **extra) -> dict:
    nbytes = 2 * n_rows * n_cols * dtype.itemsize
    return {"n_cols": n_cols, "n_rows": n_rows, "dtype": _name(dtype), "impl": impl, "ms": t.median,
            "ms_p20": t.p20, "ms_p80": t.p80, "gbps": bench.gbps(nbytes, t), **extra}


def _compiled_ref():
    from course_utils.kernels.softmax import softmax_ref
    return torch.compile(softmax_ref)


def sweep(quick: bool = False, partial: Path | None = None):
    """One row per (N, dtype, implementation): ours, torch.softmax, copy (the median of ROUNDS
    interleaved rounds), and at the lengths the notebook plots, the five eager ops and torch.compile
    of them (once)."""
    import pandas as pd

    from course_utils.kernels.softmax import softmax, softmax_ref

    reps = 10 if quick else 30
    lengths = sorted(set(SHORT_N + LONG_N + (() if quick else BETWEEN_N)))
    plotted = set(SHORT_N + LONG_N)
    compiled = _compiled_ref()
    rows = []
    for dtype in DTYPES:
        for n in lengths:
            m = rows_for(n, dtype)
            x = torch.randn(m, n, device="cuda", dtype=dtype)
            y = torch.empty_like(x)
            impls = {"ours": lambda: softmax(x),  # noqa: B023 (called at once)
                     "torch.softmax": lambda: torch.softmax(x, dim=-1),  # noqa: B023 (called at once)
                     "copy": lambda: y.copy_(x)}  # noqa: B023 (called at once)
            if n in plotted:
                impls["eager (5 ops)"] = lambda: softmax_ref(x)  # noqa: B023 (called at once)
                impls["torch.compile"] = lambda: compiled(x)  # noqa: B023 (called at once)
            timings = {impl: [] for impl in impls}
            for r in range(ROUNDS):
                for impl, fn in impls.items():
                    if (r and impl not in JUDGED) or timings[impl] is None:
                        continue
                    try:
                        timings[impl].append(_time(fn, reps))
                    except Exception as e:  # noqa: BLE001 - a failing implementation is a result too
                        _log(f"  {impl} N={n} {_name(dtype)} failed: {type(e).__name__}: {str(e)[:200]}")
                        timings[impl] = None
            for impl, ts in timings.items():
                if not ts:
                    continue
                t = sorted(ts, key=lambda t: t.median)[len(ts) // 2]
                rows.append(_row(n, m, dtype, impl, t))
                if partial is not None:
                    pd.DataFrame(rows).to_csv(partial, index=False)
                _log(f"  N={n:>6} {_name(dtype):>8} {impl:>14}: {rows[-1]['gbps']:7.0f} GB/s")
    from course_utils.kernels import softmax as S
    df = pd.DataFrame(rows).assign(split_16bit=f"{S.SPLIT_BLOCK_16BIT},{S.SPLIT_WARPS_16BIT}",
                                   split_32bit=f"{S.SPLIT_BLOCK},{S.SPLIT_WARPS}")
    return df


def ratios(df):
    """Per (N, dtype): ours / torch.softmax and ours / copy, from one run."""
    piv = df.pivot_table(index=["dtype", "n_cols"], columns="impl", values="gbps")
    out = piv.assign(vs_torch=piv["ours"] / piv["torch.softmax"], vs_copy=piv["ours"] / piv["copy"])
    return out.reset_index()


def targets(df) -> list:
    """The speed targets of issue 5 as measured ratios."""
    r = ratios(df)
    found = []
    for _, row in r.iterrows():
        n, d = int(row["n_cols"]), row["dtype"]
        if d not in ("float32", "bfloat16"):
            continue
        if n in SHORT_N:
            found.append(bench.Target(5, f"softmax {d} N={n} vs torch.softmax", row["vs_torch"], 1.0))
            if n >= 1024:
                found.append(bench.Target(5, f"softmax {d} N={n} vs copy bandwidth", row["vs_copy"], 0.85))
        elif n in LONG_N:
            found.append(bench.Target(5, f"softmax {d} N={n} (long rows) vs torch.softmax", row["vs_torch"], 1.3))
        else:
            found.append(bench.Target(5, f"softmax {d} N={n} (in between) vs torch.softmax", row["vs_torch"], 0.95))
    return found


# --------------------------------------------------------------------------- tuning and limits


def _short_candidates(n_cols):
    import triton

    from course_utils.kernels import softmax as S
    block = triton.next_power_of_2(n_cols)
    seen, out = set(), []
    for tile, warps in ((2048, 4), (4096, 4), (4096, 8), (8192, 8), (16384, 8), (16384, 16), (32768, 16)):
        tile = max(tile, block)
        if tile > 4 * block * 64 or (tile, warps) in seen:
            continue
        seen.add((tile, warps))
        out.append(S.Plan("persistent", block, tile // block, warps, 0))
    return out


def tune(out_dir: Path, split: bool = True, long_only: bool = False):
    """Time candidate plans of the persistent and split kernels; append rows to tune.csv as we go."""
    import pandas as pd

    from course_utils.kernels import softmax as S
    info = hardware.device_info()
    path = out_dir / ("softmax_tune_split16.csv" if long_only else "softmax_tune.csv")
    rows = []

    def add(r):
        rows.append(r)
        pd.DataFrame(rows).assign(**bench.provenance()).to_csv(path, index=False)

    for dtype in () if long_only else DTYPES:
        for n in SHORT_N:
            m = rows_for(n, dtype)
            x = torch.randn(m, n, device="cuda", dtype=dtype)
            y = torch.empty_like(x)
            ref = torch.softmax(x.float(), dim=-1)
            add(_row(n, m, dtype, "torch.softmax", _time(lambda: torch.softmax(x, dim=-1), 20)))  # noqa: B023 (called at once)
            add(_row(n, m, dtype, "copy", _time(lambda: y.copy_(x), 20)))  # noqa: B023 (called at once)
            for p in _short_candidates(n):
                n_tiles = -(-m // p.ROWS)
                per_sm = S.estimate_programs_per_sm(p.ROWS * p.BLOCK_SIZE, p.num_warps, info)
                for grid_name, grid in (("all", n_tiles), ("persistent", min(n_tiles, info.sms * per_sm))):
                    q = S.Plan("persistent", p.BLOCK_SIZE, p.ROWS, p.num_warps, grid)
                    try:
                        S._launch(q, y, x)
                        err = float((y.float() - ref).abs().max())
                        t = _time(lambda: S._launch(q, y, x), 20)  # noqa: B023 (called at once)
                    except Exception as e:  # noqa: BLE001
                        _log(f"  {q} failed: {type(e).__name__}: {str(e)[:200]}")
                        continue
                    add(_row(n, m, dtype, f"persistent ROWS={q.ROWS} w={q.num_warps} grid={grid_name}", t,
                             max_err=err, rows_per_tile=q.ROWS, num_warps=q.num_warps, grid=grid))
                    _log(f"  N={n} {_name(dtype)} {rows[-1]['impl']}: {rows[-1]['gbps']:.0f} GB/s err={err:.1e}")
    for dtype in (torch.bfloat16,) if long_only else DTYPES:
        for n in LONG_N + (20000, 100000):
            m = rows_for(n, dtype)
            x = torch.randn(m, n, device="cuda", dtype=dtype)
            y = torch.empty_like(x)
            ref = torch.softmax(x.float(), dim=-1)
            add(_row(n, m, dtype, "torch.softmax", _time(lambda: torch.softmax(x, dim=-1), 20)))  # noqa: B023 (called at once)
            add(_row(n, m, dtype, "copy", _time(lambda: y.copy_(x), 20)))  # noqa: B023 (called at once)
            cands = [] if long_only else [S.Plan("online", b, 1, w, m) for b, w in ((2048, 4), (4096, 8))]
            configs = ((4096, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16))
            if long_only:
                configs = ((4096, 4), (8192, 4), (8192, 8), (16384, 8), (16384, 16))
            if split:
                cands += [S.Plan("split", b, -(-n // b), w, m * -(-n // b)) for b, w in configs]
            for q in cands:
                try:
                    S._launch(q, y, x)
                    err = float((y.float() - ref).abs().max())
                    t = _time(lambda: S._launch(q, y, x), 20)  # noqa: B023 (called at once)
                except Exception as e:  # noqa: BLE001
                    _log(f"  {q} failed: {type(e).__name__}: {str(e)[:200]}")
                    continue
                add(_row(n, m, dtype, f"{q.version} BLOCK={q.BLOCK_SIZE} w={q.num_warps}", t, max_err=err,
                         num_warps=q.num_warps, block=q.BLOCK_SIZE))
                _log(f"  N={n} {_name(dtype)} {rows[-1]['impl']}: {rows[-1]['gbps']:.0f} GB/s err={err:.1e}")
    return pd.DataFrame(rows)


def _staged_row_kernel_factory():
    """The layout of Triton's official fused-softmax tutorial: a persistent loop over rows whose
    loads are software-pipelined (``num_stages``), which stages whole rows in shared memory."""
    import triton
    import triton.language as tl

    @triton.jit
    def _staged_row_kernel(y_ptr, x_ptr, n_rows, n_cols, x_row_stride, y_row_stride,
                           BLOCK_SIZE: tl.constexpr, NUM_STAGES: tl.constexpr):
        offsets = tl.arange(0, BLOCK_SIZE)
        mask = offsets < n_cols
        for row in tl.range(tl.program_id(0), n_rows, tl.num_programs(0), num_stages=NUM_STAGES):
            x = tl.load(x_ptr + row * x_row_stride + offsets, mask=mask, other=-float("inf"))
            x = x - tl.max(x, axis=0)
            e = tl.exp(x)
            tl.store(y_ptr + row * y_row_stride + offsets, e / tl.sum(e, axis=0), mask=mask)

    return _staged_row_kernel


def limits(out_dir: Path):
    """The one-row-per-program kernel (v2) at growing N in fp32: what the compiler made of it
    (registers, spills, shared memory), the occupancy that follows, its bandwidth on a 256 MiB
    input, or the error it raised; and the tutorial's pipelined layout, which fails sooner."""
    import pandas as pd
    import triton

    from course_utils.kernels import softmax as S
    info = hardware.device_info()
    spec = hardware.current()
    smem_per_sm = spec.smem_per_sm_kib * 1024 if spec else info.smem_per_block_bytes
    rows = []
    for n in (1024, 4096, 16384, 32768, 65536, 131072, 262144):
        for warps in sorted({S.warps_for(n), 8, 16} if n <= 65536 else {16}):
            block = triton.next_power_of_2(n)
            m = rows_for(n, torch.float32)
            x = torch.randn(m, n, device="cuda")
            y = torch.empty_like(x)
            r = {"kernel": "one row per program (v2)", "n_cols": n, "dtype": "float32", "BLOCK_SIZE": block,
                 "num_warps": warps, "num_stages": 1}

            def run(x=x, y=y, block=block, warps=warps, n=n):
                return S._softmax_row_kernel[(x.shape[0],)](y, x, n, x.stride(0), y.stride(0),
                                                            BLOCK_SIZE=block, num_warps=warps)
            try:
                k = run()
                torch.cuda.synchronize()
                occ = S.occupancy(k, warps, info, smem_per_sm)
                t = _time(run, 10)
                r.update(occ, n_spills=getattr(k, "n_spills", None), error="",
                         gbps=bench.gbps(2 * x.numel() * 4, t),
                         max_err=float((y[:64] - torch.softmax(x[:64], -1)).abs().max()))
            except Exception as e:  # noqa: BLE001 - the error is the result
                r.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
            rows.append(r)
            _log(str(r))
    staged = _staged_row_kernel_factory()
    for n in (4096, 16384, 32768, 65536):
        for stages in (2, 4):
            x = torch.randn(1024, n, device="cuda")
            y = torch.empty_like(x)
            r = {"kernel": "tutorial layout, pipelined", "n_cols": n, "dtype": "float32",
                 "BLOCK_SIZE": triton.next_power_of_2(n), "num_warps": 8, "num_stages": stages}
            try:
                k = staged[(info.sms,)](y, x, 1024, n, x.stride(0), y.stride(0),
                                        BLOCK_SIZE=triton.next_power_of_2(n), NUM_STAGES=stages, num_warps=8)
                torch.cuda.synchronize()
                r.update(S.occupancy(k, 8, info, smem_per_sm), error="")
            except Exception as e:  # noqa: BLE001
                r.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
            rows.append(r)
            _log(str(r))
    df = pd.DataFrame(rows).assign(**bench.provenance())
    df.to_csv(out_dir / "softmax_limits.csv", index=False)
    return df


def check() -> None:
    """Every version against float64 on odd shapes, strides and edge rows (prints one line each)."""
    from course_utils.kernels import softmax as S
    torch.manual_seed(int(time.time()))
    cases = [(7, 13), (1000, 1000), (33, 4097), (3, 16385), (9, 20000), (300, 100003), (2, 1_000_000)]
    for dtype in (torch.float32, torch.bfloat16):
        tol = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
        for m, n in cases:
            x = (torch.randn(m, n + 3, device="cuda") * 4 + 50).to(dtype)[:, :n]  # strided rows
            x[0, :: max(1, n // 5)] = 1e4 if dtype != torch.float16 else 6e4
            ref = torch.softmax(x.double(), -1)
            for v in ("fused", "persistent", "online", "split", None):
                if v in ("fused", "persistent") and n > 16384:
                    continue
                y = S.softmax(x, version=v)
                torch.cuda.synchronize()
                err = float((y.double() - ref).abs().max())
                ok = err <= tol and not y.isnan().any()
                verdict = "ok " if ok else "BAD"
                print(f"{verdict} {_name(dtype):>8} {m}x{n} {v or 'auto'}: max err {err:.2e}", flush=True)
    x = torch.full((3, 40000), float("-inf"), device="cuda")
    x[1, 12345] = 1.0
    y = S.softmax(x)
    print("all -inf rows ->", "NaN like torch" if bool(y[0].isnan().all() and y[2].isnan().all()) else "NOT NaN",
          "| one finite ->", "one-hot" if float(y[1, 12345]) == 1.0 else "WRONG", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("what", choices=["sweep", "tune", "limits", "check"])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-split", action="store_true")
    ap.add_argument("--long-only", action="store_true", help="tune: only the split kernel, bf16")
    ap.add_argument("--split-16bit", default=None, help="BLOCK,WARPS of the split kernel for 16-bit inputs")
    a = ap.parse_args(argv)
    if a.split_16bit:
        from course_utils.kernels import softmax as S
        S.SPLIT_BLOCK_16BIT, S.SPLIT_WARPS_16BIT = (int(v) for v in a.split_16bit.split(","))
    if not cu.on_gpu():
        print("benchmarks.softmax needs a CUDA GPU", file=sys.stderr)
        return 2
    out = a.out or (bench.RESULTS / bench.gpu_slug())
    out.mkdir(parents=True, exist_ok=True)
    if a.what == "check":
        check()
    elif a.what == "limits":
        limits(out)
    elif a.what == "tune":
        tune(out, split=not a.no_split, long_only=a.long_only)
    else:
        import pandas as pd
        df = sweep(a.quick, partial=out / "softmax_partial.csv").assign(**bench.provenance())
        df.to_csv(out / "softmax.csv", index=False)
        r = ratios(df)
        r.to_csv(out / "softmax_ratios.csv", index=False)
        pd.set_option("display.width", 200)
        print(r.round(3).to_string(index=False))
        print(pd.DataFrame([t.row() for t in targets(df)]).to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
