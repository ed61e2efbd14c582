"""Softmax along rows (chapters 5 and 6): ours against torch.softmax, torch.compile and eager.

``sweep()`` times every implementation at each row length N with M rows chosen so that the input is
256 MiB, in fp32 and bf16, next to a device-to-device copy of the same bytes (the ceiling).
GB/s count the minimum traffic: one read of x and one write of y. Two of ours: "ours" is the tuned
shelf (``course_utils.tuned.softmax.softmax``, what the targets judge: for N <= 16384 its plan runs
the multi-row persistent kernel), "teaching" the kernels the chapters print (``softmax_teaching``,
one row per program, for N <= 32768; ``softmax_online_teaching`` beyond).

    python -m benchmarks.softmax sweep   [--out DIR]   # the sweep make bench runs, CSV + table
    python -m benchmarks.softmax tune    [--out DIR]   # candidate tiles/warps/grids, CSV
    python -m benchmarks.softmax limits  [--out DIR]   # registers, shared memory, occupancy, errors
    python -m benchmarks.softmax check                  # correctness on the GPU, every version
    python -m benchmarks.softmax explore [--out DIR]   # the dips (vector loads) and the pipelined persistent grid
    python -m benchmarks.softmax ptx     [--out DIR]   # CPU: async copies and load widths in the sm_90 PTX
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

import course_utils as cu
from course_utils import bench, hardware
from course_utils.tuned.softmax import tile_rows

TITLE = "Softmax along rows: fused, persistent, online and split versions"
INPUT_BYTES = 256 * 2**20
SHORT_N = (256, 1024, 4096, 16384)
LONG_N = (32768, 65536, 262144)
DIPS_N = (1000, 12000)  # lengths whose row stride is not a multiple of 16 elements (1000), and 12000 (H200)
BETWEEN_N = (384, 3000, 6000, 17000, 20000, 26000, 50000, 100000, 200000)
JUDGED = ("ours", "teaching", "torch.softmax", "copy")  # timed in interleaved rounds, the median round kept
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
    return {"n_cols": n_cols, "n_rows": n_rows, "dtype": _name(dtype), "impl": impl, **t.columns(),
            "gbps": bench.gbps(nbytes, t), **extra}


def _compiled_ref():
    from course_utils.kernels.softmax import softmax_ref
    return torch.compile(softmax_ref)


def teaching_for(n_cols: int):
    """The teaching kernel a chapter shows for rows of ``n_cols``: v2 while a row fits, else v3."""
    from course_utils.kernels import softmax as K
    return K.softmax_teaching if n_cols <= K.MAX_TEACHING_BLOCK else K.softmax_online_teaching


def sweep(quick: bool = False, partial: Path | None = None):
    """One row per (N, dtype, implementation): ours, teaching, torch.softmax, copy (the median of
    ROUNDS interleaved rounds), and at the lengths the notebook plots, the five eager ops and
    torch.compile of them (once)."""
    import pandas as pd

    from course_utils.kernels.softmax import softmax_ref
    from course_utils.tuned import softmax as S

    reps = 10 if quick else 30
    lengths = sorted(set(SHORT_N + LONG_N + DIPS_N + (() if quick else BETWEEN_N)))
    plotted = set(SHORT_N + LONG_N)
    compiled = _compiled_ref()
    rows = []
    for dtype in DTYPES:
        for n in lengths:
            m = rows_for(n, dtype)
            x = torch.randn(m, n, device="cuda", dtype=dtype)
            y = torch.empty_like(x)
            teaching = teaching_for(n)
            judged = {"ours": lambda: S.softmax(x), "teaching": lambda: teaching(x),  # noqa: B023 (called at once)
                      "torch.softmax": lambda: torch.softmax(x, dim=-1), "copy": lambda: y.copy_(x)}  # noqa: B023
            errors: dict = {}
            timings = bench.time_rounds(judged, rounds=ROUNDS, errors=errors, warmup=5, rep=reps)
            if n in plotted:
                once = {"eager (5 ops)": lambda: softmax_ref(x), "torch.compile": lambda: compiled(x)}  # noqa: B023
                timings.update(bench.time_rounds(once, rounds=1, errors=errors, warmup=5, rep=reps))
            for impl, err in errors.items():
                _log(f"  {impl} N={n} {_name(dtype)} failed: {err[:200]}")
            for impl, t in timings.items():
                rows.append(_row(n, m, dtype, impl, t))
                if partial is not None:
                    pd.DataFrame(rows).to_csv(partial, index=False)
                _log(f"  N={n:>6} {_name(dtype):>8} {impl:>14}: {rows[-1]['gbps']:7.0f} GB/s")
    df = pd.DataFrame(rows).assign(split_16bit=f"{S.SPLIT_BLOCK_16BIT},{S.SPLIT_WARPS_16BIT}",
                                   split_32bit=f"{S.SPLIT_BLOCK},{S.SPLIT_WARPS}")
    return df


def ratios(df):
    """Per (N, dtype): ours / torch.softmax and ours / copy, from one run."""
    piv = df.pivot_table(index=["dtype", "n_cols"], columns="impl", values="gbps")
    out = piv.assign(vs_torch=piv["ours"] / piv["torch.softmax"], vs_copy=piv["ours"] / piv["copy"])
    if "teaching" in piv:
        out = out.assign(teaching_vs_copy=piv["teaching"] / piv["copy"],
                         tuned_vs_teaching=piv["ours"] / piv["teaching"])
    return out.reset_index()


def targets(df) -> list:
    """The speed targets of issue 5 as measured ratios."""
    r = ratios(df)
    timed = df.set_index(["dtype", "n_cols", "impl"])
    found = []
    for _, row in r.iterrows():
        n, d = int(row["n_cols"]), row["dtype"]
        if d not in ("float32", "bfloat16"):
            continue
        # against torch.softmax: both rows' spread and % of copy go along, so a tie at the ceiling is not a loss
        ties = bench.tie_evidence(*(timed.loc[(d, n, impl)] if (d, n, impl) in timed.index else {}
                                    for impl in ("ours", "torch.softmax")))
        if n in SHORT_N:
            found.append(bench.Target(5, f"softmax {d} N={n} vs torch.softmax", row["vs_torch"], 1.0, **ties))
            if n >= 1024:
                found.append(bench.Target(5, f"softmax {d} N={n} vs copy bandwidth", row["vs_copy"], 0.85))
        elif n in LONG_N:
            found.append(bench.Target(5, f"softmax {d} N={n} (long rows) vs torch.softmax", row["vs_torch"], 1.3,
                                      **ties))
        else:
            found.append(bench.Target(5, f"softmax {d} N={n} (in between) vs torch.softmax", row["vs_torch"], 0.95,
                                      **ties))
    return found


# --------------------------------------------------------------------------- tuning and limits


def _short_candidates(n_cols):
    import triton

    from course_utils.tuned import softmax as S
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

    from course_utils.tuned import softmax as S
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
                    q = S.Plan("persistent", p.BLOCK_SIZE, p.ROWS, p.num_warps, grid,
                               stages=1 if grid == n_tiles else S.PIPELINE_STAGES)
                    try:
                        S.launch(q, y, x)
                        err = float((y.float() - ref).abs().max())
                        t = _time(lambda: S.launch(q, y, x), 20)  # noqa: B023 (called at once)
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
                    S.launch(q, y, x)
                    err = float((y.float() - ref).abs().max())
                    t = _time(lambda: S.launch(q, y, x), 20)  # noqa: B023 (called at once)
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

    from course_utils.kernels import softmax as K
    from course_utils.tuned import softmax as S
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
                return K.softmax_row_kernel[(x.shape[0],)](y, x, n, x.stride(0), y.stride(0),
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
    from course_utils.tuned import softmax as S
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


# --------------------------------------------------------------------------- loops and vector loads


@triton.jit
def softmax_persistent_while_kernel(y_ptr, x_ptr, n_rows, n_cols_a, x_stride_a, y_stride_a, n_tiles,
                                    BLOCK_SIZE: tl.constexpr, ROWS: tl.constexpr, ALIGN: tl.constexpr):
    """The tuned persistent kernel with its tile loop written as a ``while`` loop, as the course had
    it: the same body, for the comparison (Triton's pipeliner skips while loops)."""
    n_cols, x_row_stride, y_row_stride = n_cols_a * ALIGN, x_stride_a * ALIGN, y_stride_a * ALIGN
    cols = tl.arange(0, BLOCK_SIZE)
    col_mask = cols < n_cols
    tile = tl.program_id(0)
    while tile < n_tiles:
        rows = tile_rows(tile, ROWS)
        mask = (rows < n_rows)[:, None] & col_mask[None, :]
        x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask,
                    other=-float("inf")).to(tl.float32)
        x = x - tl.max(x, axis=1)[:, None]
        numerator = tl.exp(x)
        y = numerator * (1.0 / tl.sum(numerator, axis=1))[:, None]
        tl.store(y_ptr + rows[:, None] * y_row_stride + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
        tile += tl.num_programs(0)


def launch_while(p, y2, x2, num_stages: int = 3):
    """Launch plan ``p`` (persistent) with the while-loop twin of the tuned kernel."""
    from course_utils.tuned import softmax as S
    n_rows, n_cols = x2.shape
    a = S.alignment(n_cols, x2.stride(0), y2.stride(0))
    softmax_persistent_while_kernel[(p.grid,)](y2, x2, n_rows, n_cols // a, x2.stride(0) // a, y2.stride(0) // a,
                                               triton.cdiv(n_rows, p.ROWS), BLOCK_SIZE=p.BLOCK_SIZE, ROWS=p.ROWS,
                                               ALIGN=a, num_warps=p.num_warps, num_stages=num_stages)


def load_widths(ptx: str) -> dict:
    """Global loads in PTX by bytes per instruction per thread, e.g. {16: 4} for four ld.global.v4.b32."""
    import re
    widths: dict = {}
    for vec, bits in re.findall(r"\bld\.global(?:\.[a-z]+\d*)*?(?:\.v(\d))?\.[bfsu](\d+)\b", ptx):
        nbytes = int(vec or 1) * int(bits) // 8
        widths[nbytes] = widths.get(nbytes, 0) + 1
    return widths


def ptx_facts(arch: int = 90):
    """CPU, compiled mode (``python -m benchmarks.softmax ptx``): for sm_``arch``, the async copies
    (software pipelining) of the persistent tile loop as ``tl.range`` with 1 and 3 stages and as a
    ``while`` loop with num_stages=3, and the widths of the loads of rows whose stride is a multiple
    of 8 but not 16 elements, with and without the tuned shelf's ALIGN hint."""
    import pandas as pd

    from course_utils import aot
    from course_utils.kernels import softmax as K
    from course_utils.tuned import softmax as S
    info = hardware.DeviceInfo.for_arch(arch)
    rows = []

    def add(what, call, **extra):
        for r in aot.ptx_of(call, arch):
            rows.append({"arch": arch, "what": what, "kernel": r["kernel"].rsplit(".", 1)[-1], **extra,
                         "num_stages": r["num_stages"], **aot.async_copies(r["ptx"]),
                         "load_bytes": " ".join(f"{k}Bx{v}" for k, v in sorted(load_widths(r["ptx"]).items())),
                         "widest_load_bytes": max(load_widths(r["ptx"]) or [0]), "shared_bytes": r["shared_bytes"]})

    for dtype in (torch.float32, torch.bfloat16):
        for n in (1000, 4096):
            x, y = torch.empty(4096, n, dtype=dtype), torch.empty(4096, n, dtype=dtype)
            kw = {"dtype": _name(dtype), "n_cols": n}
            for stages in (1, 3):
                add(f"persistent grid, tl.range num_stages={stages}",
                    lambda s=stages, x=x, y=y, n=n: S.launch(S.persistent_grid_plan(4096, n, info, s), y, x), **kw)
            add("persistent grid, while loop, num_stages=3",
                lambda x=x, y=y, n=n: launch_while(S.persistent_grid_plan(4096, n, info, 3), y, x, 3), **kw)
        add("teaching online kernel, tl.range num_stages=3 (default)",
            lambda dtype=dtype: K.softmax_online_teaching(torch.empty(4, 100_000, dtype=dtype)),
            dtype=_name(dtype), n_cols=100_000)
        for n in (1000, 1024, 12000):
            for hint in (False, True):
                def plan_launch(n=n, hint=hint, dtype=dtype):
                    saved, S.VECTOR_HINT = S.VECTOR_HINT, hint
                    try:
                        S.softmax(torch.empty(64, n, dtype=dtype))
                    finally:
                        S.VECTOR_HINT = saved
                add(f"tuned plan, ALIGN hint {'on' if hint else 'off'}", plan_launch, dtype=_name(dtype), n_cols=n)
    return pd.DataFrame(rows).assign(triton=__import__("triton").__version__)


def explore(out_dir: Path):
    """GPU: (1) the dips: bf16/fp32 rows of 1000 and 12000 (and 1024 beside them) with the ALIGN hint
    on and off, against torch.softmax and a copy; (2) chapter 5's persistent grid with its tile loop
    as tl.range (1 and 3 stages) and as the old while loop, against one tile per program; (3) the
    online kernel with 1 and 3 stages. Interleaved rounds, 256 MiB inputs; two CSVs."""
    from course_utils.tuned import softmax as S
    info = hardware.device_info()

    def hinted(fn, hint):
        def run():
            saved, S.VECTOR_HINT = S.VECTOR_HINT, hint
            try:
                return fn()
            finally:
                S.VECTOR_HINT = saved
        return run

    dips, grids = [], []
    for dtype in DTYPES:
        for n in (1000, 1024, 12000):
            m = rows_for(n, dtype)
            x = torch.randn(m, n, device="cuda", dtype=dtype)
            y = torch.empty_like(x)
            ref = torch.softmax(x.float(), -1)
            for hint in (False, True):
                err = float((hinted(lambda: S.softmax(x), hint)().float() - ref).abs().max())  # noqa: B023
                _log(f"  dips N={n} {_name(dtype)} hint={hint}: max err {err:.1e}")
            impls = {"ours, ALIGN hint on": hinted(lambda: S.softmax(x), True),  # noqa: B023 (called at once)
                     "ours, ALIGN hint off": hinted(lambda: S.softmax(x), False),  # noqa: B023
                     "torch.softmax": lambda: torch.softmax(x, -1), "copy": lambda: y.copy_(x)}  # noqa: B023
            for impl, t in bench.time_rounds(impls, rounds=ROUNDS, warmup=5, rep=30).items():
                dips.append(_row(n, m, dtype, impl, t, align=S.alignment(n, n, n) if "on" in impl else 1))
                _log(f"  dips N={n} {_name(dtype)} {impl}: {dips[-1]['gbps']:.0f} GB/s")
        for n in (1000, 4096):
            m = rows_for(n, dtype)
            x = torch.randn(m, n, device="cuda", dtype=dtype)
            y = torch.empty_like(x)
            ref = torch.softmax(x.float(), -1)
            full = S.plan(m, n, info, dtype.itemsize)
            impls = {"one tile per program (the plan)": lambda p=full: S.launch(p, y, x),  # noqa: B023
                     "copy": lambda: y.copy_(x)}  # noqa: B023
            for stages in (1, S.PIPELINE_STAGES):
                p = S.persistent_grid_plan(m, n, info, stages, full.ROWS, full.num_warps)
                impls[f"persistent grid, tl.range num_stages={stages}"] = lambda p=p: S.launch(p, y, x)  # noqa: B023
            p1 = S.persistent_grid_plan(m, n, info, 1, full.ROWS, full.num_warps)
            impls["persistent grid, while loop"] = lambda p=p1: launch_while(p, y, x)  # noqa: B023
            errors: dict = {}
            for impl, fn in impls.items():
                if impl != "copy":
                    fn()
                    e = float((y.float() - ref).abs().max())
                    if not e < 1e-2:
                        errors[impl] = f"max err {e:.1e}"
            timings = bench.time_rounds({k: v for k, v in impls.items() if k not in errors}, rounds=ROUNDS,
                                        errors=errors, warmup=5, rep=30)
            for impl, t in timings.items():
                grids.append(_row(n, m, dtype, impl, t, grid=p1.grid if "persistent" in impl else None,
                                  rows_per_tile=full.ROWS, num_warps=full.num_warps))
                _log(f"  grid N={n} {_name(dtype)} {impl}: {grids[-1]['gbps']:.0f} GB/s")
            for impl, e in errors.items():
                _log(f"  grid N={n} {_name(dtype)} {impl} FAILED: {e}")
        for n in (262144,):  # the online kernel (v3, and the plan's last resort): pipelined or not
            from course_utils.kernels import softmax as K
            m = rows_for(n, dtype)
            x = torch.randn(m, n, device="cuda", dtype=dtype)
            y = torch.empty_like(x)
            impls = {f"online (v3), tl.range num_stages={st}":
                     lambda st=st: K.softmax_online_kernel[(m,)](y, x, n, n, n, BLOCK_SIZE=S.ONLINE_BLOCK,  # noqa: B023
                                                                 NUM_STAGES=st, num_warps=8) for st in (1, 3)}
            impls["copy"] = lambda: y.copy_(x)  # noqa: B023
            errors = {}
            for impl, t in bench.time_rounds(impls, rounds=ROUNDS, errors=errors, warmup=5, rep=30).items():
                grids.append(_row(n, m, dtype, impl, t))
                _log(f"  online N={n} {_name(dtype)} {impl}: {grids[-1]['gbps']:.0f} GB/s")
            for impl, e in errors.items():
                _log(f"  online N={n} {_name(dtype)} {impl} FAILED: {e}")
        _save_explore(out_dir, dips, grids, final=dtype == DTYPES[-1])  # after each dtype: a cut-short run keeps it


def _save_explore(out_dir: Path, dips: list, grids: list, final: bool) -> None:
    import pandas as pd
    for name, rows in (("softmax_dips_explore", dips), ("softmax_persistent_explore", grids)):
        df = pd.DataFrame(rows)
        copy = df[df.impl == "copy"].set_index(["dtype", "n_cols"])["gbps"]
        df["pct_of_copy"] = [100 * g / copy[(d, n)] for g, d, n in zip(df.gbps, df.dtype, df.n_cols)]
        df.assign(**bench.provenance()).to_csv(out_dir / f"{name}.csv", index=False)
        if final:
            print(df[["dtype", "n_cols", "impl", "gbps", "pct_of_copy"]].round(1).to_string(index=False), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("what", choices=["sweep", "tune", "limits", "check", "explore", "ptx"])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-split", action="store_true")
    ap.add_argument("--long-only", action="store_true", help="tune: only the split kernel, bf16")
    ap.add_argument("--split-16bit", default=None, help="BLOCK,WARPS of the split kernel for 16-bit inputs")
    a = ap.parse_args(argv)
    if a.split_16bit:
        from course_utils.tuned import softmax as S
        S.SPLIT_BLOCK_16BIT, S.SPLIT_WARPS_16BIT = (int(v) for v in a.split_16bit.split(","))
    if a.what == "ptx":  # compiles for sm_90 on any machine, in a process where TRITON_INTERPRET is unset
        return _ptx_main(a.out or (bench.RESULTS / "ptx"))
    if not cu.on_gpu():
        print("benchmarks.softmax needs a CUDA GPU", file=sys.stderr)
        return 2
    out = a.out or (bench.RESULTS / bench.gpu_slug())
    out.mkdir(parents=True, exist_ok=True)
    if a.what == "check":
        check()
    elif a.what == "limits":
        limits(out)
    elif a.what == "explore":
        explore(out)
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


def _ptx_main(out: Path) -> int:
    import subprocess

    from course_utils import aot
    code = ("import sys, triton, triton.language\nfrom course_utils import aot\nimport os\n"
            "os.environ.pop('TRITON_INTERPRET', None)\nfrom benchmarks import softmax as b\n"
            "df = b.ptx_facts(90)\nimport pathlib\nout = pathlib.Path(sys.argv[1])\n"
            "out.mkdir(parents=True, exist_ok=True)\ndf.to_csv(out / 'softmax_ptx.csv', index=False)\n"
            "print(df.drop(columns=['triton']).to_string(index=False))\n")
    return subprocess.call([sys.executable, "-c", code, str(out)], env=aot.subprocess_env())


if __name__ == "__main__":
    sys.exit(main())
