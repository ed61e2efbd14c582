"""Checks for chapter 10's backward exercises: the dw/db stage-1 reduction (every partial row compared; RMSNorm's
dx with rstd recomputed is in :mod:`.rms_backward`); each docstring gives the launch. :mod:`.layernorm`
re-exports them. Each check first refuses the course's answers handed in or called (``layernorm_common.refuse``:
``check.refuse_answer_key`` over chapter 10's answer keys; tests/test_layernorm_checkers.py holds both refusals).
"""

from __future__ import annotations

import torch
import triton

from .. import check, env
from .layernorm_common import (
    _inputs,
    _launch,
    _stats64,
    refuse,
)
from .loads import LOADS_SEEN
from .offsets64 import wide_case, wide_launch, wide_rows


def _read_with_stride(t: torch.Tensor, stride: int) -> torch.Tensor:
    """The rows of the 2-D ``t`` as a kernel reads them with another row ``stride``, in float64, as many as stay
    inside ``t``'s own elements (row 0 included, which any stride reads right)."""
    n_rows, n_cols = t.shape
    last = (n_rows - 1) * t.stride(0) + n_cols       # one past t's last element
    flat = t.as_strided((last,), (1,)).to("cpu", torch.float64)
    rows = min(n_rows, (last - n_cols) // stride + 1)
    return torch.stack([flat[r * stride:r * stride + n_cols] for r in range(rows)])



# --------------------------------------------------------------------------- the dw/db reduction

DW_HINT = ("program (pid_m, pid_n) sums its own rows [pid_m * rows_per_program, ...), never past n_rows, in tiles of "
           "BLOCK_M rows, one float32 sum per column, stored in row pid_m of dw_partial and db_partial.")


def _run_sums(v: torch.Tensor, bounds) -> torch.Tensor:
    return torch.stack([v[a:b].sum(0) for a, b in bounds])

#: nonzero float32 sums that all land on 16-bit numbers: no chance (each about 1 in 2^13), a 16-bit accumulator
DTYPE_EVIDENCE = 16


def _in_dtype(got: torch.Tensor, dtype) -> bool:
    """Every float32 sum of ``got`` is a ``dtype`` number (at least DTYPE_EVIDENCE of them nonzero)."""
    return dtype != torch.float32 and int(got.ne(0).sum()) >= DTYPE_EVIDENCE and \
        torch.equal(got.to(dtype).double(), got)


#: a float32 sum of a run's float32 terms is off by far less than this, relative to the sum of their |values|
F32_RUN = 2e-6


def _tile_sums_16bit(got, v, n_rows, rows_per_program, dtype) -> bool:
    """The partial rows are each run's sums to 16-bit accuracy, not float32's: more than a tenth of them off by more
    than F32_RUN of their terms' |values| (a float32 sum's error stays about 100 times below), though close."""
    if dtype == torch.float32:
        return False
    bounds = [(s, min(s + rows_per_program, n_rows)) for s in range(0, n_rows, rows_per_program)]
    want, size = _run_sums(v, bounds), _run_sums(v.abs(), bounds)
    off = (got - want).abs()
    return bool((off <= 0.05 * size).all()) and float((off > F32_RUN * size).double().mean()) > 0.1


def _dw_diagnose(got, v, n_rows, rows_per_program, block_m, what, dtype=torch.float32) -> str:
    """Which mistake the partial rows look like, from sums over other row ranges ("" when none fits)."""
    tiles, total = triton.cdiv(rows_per_program, block_m) * block_m, v.sum(0)
    close = lambda a, b: bool(torch.allclose(a, b, rtol=1e-3, atol=1e-2 * float(b.abs().max().clamp_min(1))))  # noqa: E731
    if not bool(torch.isfinite(got).all()):
        return ""
    name = str(dtype).removeprefix("torch.")
    if _in_dtype(got, dtype):
        return (f"every partial {what} sum is a {name} number: the sums were accumulated (or rounded) in the input's "
                f"dtype, {name}, whose rounding (about {torch.finfo(dtype).eps:.0e} of the sum) the check sees. "
                f"Accumulate in float32: {what} = tl.zeros((BLOCK_N,), dtype=tl.float32), adding float32 values.")
    if _tile_sums_16bit(got, v, n_rows, rows_per_program, dtype):
        return (f"the partial {what} sums are right to {name}'s precision only, not float32's: a tile's values were "
                f"summed in {name} (tl.sum of a {name} tile returns {name}) before they reached the float32 "
                f"accumulator. Convert dy and x with .to(tl.float32) right after each tl.load, so that every tile sum "
                "is float32.")
    if tiles != rows_per_program and close(got, _run_sums(v, [(s, min(s + tiles, n_rows)) for s in
                                                              range(0, n_rows, rows_per_program)])):
        return (f"each partial {what} row also holds the rows of the next run that its last tile covers: the rows of "
                "a tile were masked with rows < n_rows, so the next program counts them again. A tile's rows end at "
                "the run's end, end = min(first + rows_per_program, n_rows): mask with rows < end.")
    for want, which in ((total[None].expand_as(got), "every partial row"), (torch.cat([total[None], 0 * got[1:]]),
                                                                           "partial row 0 (the others 0)")):
        if close(got, want):
            return f"{which} holds the {what} sum of ALL rows: each program sums only its own run of rows."
    full = [(s, s + (min(s + rows_per_program, n_rows) - s) // block_m * block_m) for s in range(0, n_rows,
                                                                                              rows_per_program)]
    if any(b - a < min(rows_per_program, n_rows - a) for a, b in full) and close(got, _run_sums(v, full)):
        return (f"each partial {what} row misses the rows of its run's last, partial tile: the tile loop stops before "
                "a tile that runs past the run's end (as while start + BLOCK_M <= end does). Loop while start < end "
                "and mask the tile's rows with rows < end.")
    first = [(s, min(s + block_m, s + rows_per_program, n_rows)) for s in range(0, n_rows, rows_per_program)]
    if block_m < rows_per_program and close(got, _run_sums(v, first)):
        return (f"each partial {what} row holds the sum of the first BLOCK_M rows of its run only: loop over the run "
                "in tiles of BLOCK_M rows, for start in tl.range(first, end, BLOCK_M), adding every tile's sums.")
    if close(got.sum(0), total):
        return (f"the partial {what} rows add up to the right sums but are not each run's own: program pid_m stores "
                "the sum over rows [pid_m * rows_per_program, ...) in row pid_m.")
    if close(got.sum(0).sum(), total.sum()):
        return (f"the grand total of your sums is right but not the sum of each column: {what} is summed over the "
                f"wrong axis. tl.sum(tile, axis=1) adds up a row of the tile; {what}[j] is tl.sum(tile, axis=0).")
    return ""


def _dw_stride_hint(got, what, x, dy, mean, rstd, bounds) -> str:
    """The partial rows one tensor's rows read with the other's row stride give, compared on the runs that stay
    inside that tensor's memory: a stride mix-up named from the output alone (a GPU check records no loads)."""
    if x.stride(0) == dy.stride(0):
        return ""
    x64, dy64 = x.to("cpu", torch.float64), dy.to("cpu", torch.float64)
    mean64, rstd64 = mean.to("cpu", torch.float64)[:, None], rstd.to("cpu", torch.float64)[:, None]
    for name, other, stride in (("dy", "x", x.stride(0)), ("x", "dy", dy.stride(0)))[:2 if what == "dw" else 1]:
        read = _read_with_stride(dy if name == "dy" else x, stride)   # db reads no x
        k = read.shape[0]
        xs, dys = (x64[:k], read) if name == "dy" else (read, dy64[:k])
        v = dys * (xs - mean64[:k]) * rstd64[:k] if what == "dw" else dys
        inside = [p for p, (_, end) in enumerate(bounds) if end <= k and end - bounds[p][0] > 1]
        if not inside or not bool(torch.isfinite(got[inside]).all()):
            continue
        want = _run_sums(v, [bounds[p] for p in inside])
        if torch.allclose(got[inside], want, rtol=1e-3, atol=1e-3 * float(want.abs().max().clamp_min(1.0))):
            return (f"the partial {what} rows are what {name} read with {other}'s row stride gives ({stride} elements "
                    f"between rows, not {name}_row_stride): each tensor has its own row stride.")
    return ""


NAN_STATS_HINT = ("a NaN reached your sums. The check puts NaN right after mean and rstd in memory, so the likely "
                  "cause is a tile that loaded them past n_rows: load the statistics with the tile's row mask "
                  "(mask=rows < end, other=0.0), as x and dy.")


def _dw_input_hint(got, what, x64, dy64, mean64, rstd64, bounds) -> str:
    """x_hat without the mean or without rstd, dw holding dy's sums, or NaN from the statistics read past their
    end (the check puts NaN there)."""
    if not bool(torch.isfinite(got).all()):
        return NAN_STATS_HINT if bool(torch.isnan(got).any()) else ""
    if what != "dw":
        return ""
    fits = lambda want: torch.allclose(got, want, rtol=1e-3, atol=1e-3 * float(want.abs().max().clamp_min(1.0)))  # noqa: E731
    if fits(_run_sums((x64 - mean64[:, None]) * rstd64[:, None], bounds)):
        return "dw matches sum(x_hat): dw sums dy * x_hat, the upstream gradient times x_hat."
    if fits(_run_sums(dy64 * x64 * rstd64[:, None], bounds)):
        return "dw matches sum(dy * x * rstd): x_hat = (x - mean) * rstd subtracts the row's mean first."
    if fits(_run_sums(dy64 * (x64 - mean64[:, None]), bounds)):
        return "dw matches sum(dy * (x - mean)): x_hat = (x - mean) * rstd, times the row's rstd too."
    if fits(_run_sums(dy64, bounds)):
        return ("the partial dw rows hold db's sums, sum(dy): dw sums dy * x_hat, x_hat = (x - mean) * rstd (if db "
                "holds dw's sums, the two stores are swapped: dw_partial_ptr gets dw, db_partial_ptr db).")
    return ""


def _dw_case(kernel, n_rows, n_cols, dtype, block_m, block_n, rows_per_program):
    case = (f"dw/db reduction ({str(dtype).removeprefix('torch.')}, {n_rows} rows x {n_cols} cols, BLOCK_M={block_m}, "
            f"BLOCK_N={block_n}, rows_per_program={rows_per_program})")
    xg, x = _inputs(n_rows, n_cols, dtype)
    dy = check.randn((n_rows, n_cols + 3), dtype)[:, :n_cols]  # strided too
    x64, mean64, rstd64 = _stats64(x)
    # NaN after the statistics: a row tile that loads them without the row mask reads NaN past n_rows
    mean, rstd = (check.nan_tailed(s.float().to(x.device), tail=block_m) for s in (mean64, rstd64))
    n_programs = triton.cdiv(n_rows, rows_per_program)
    dw = check.Guarded((n_programs, n_cols), torch.float32)
    db = check.Guarded((n_programs, n_cols), torch.float32)
    grid = (n_programs, triton.cdiv(n_cols, block_n))
    signature = ("It is launched as " + check_dw_db_kernel.__doc__.split("``")[1] + "\nIf the error is about shapes: "
                 "dw and db hold one sum per column; tl.sum(tile, axis=1) gives one per row: reduce over axis 0.")
    _launch(signature, lambda: kernel[grid](dw.tensor, db.tensor, x, dy, mean, rstd, n_rows, n_cols, x.stride(0),
                                            dy.stride(0), rows_per_program, BLOCK_M=block_m, BLOCK_N=block_n),
            case, DW_HINT, (x, dy, mean, rstd), {"x": x, "dy": dy},
            {"x_row_stride": x.stride(0), "dy_row_stride": dy.stride(0), "n_cols": n_cols})
    for g, what in ((dw, "dw_partial"), (db, "db_partial")):
        g.check(f"{case}, {what}", "mask the columns of the last block: cols < n_cols")
    # whole rows of both still NaN, as the check filled them (db reads no statistics: no NaN reaches its sums)
    unwritten = [p for p in range(n_programs) if all(bool(torch.isnan(g.tensor[p]).all()) for g in (dw, db))]
    if unwritten:
        raise check.CheckFailure(
            f"{case}: partial rows {unwritten[:8]} of dw_partial and db_partial hold only the NaN the check filled "
            "them with: they were never written. Program pid_m stores its sums in row pid_m, dw_partial_ptr + "
            "pid_m * n_cols + cols (and db_partial_ptr + pid_m * n_cols + cols).")
    dy64 = dy.to("cpu", torch.float64)
    x_hat = (x64 - mean.cpu().double()[:, None]) * rstd.cpu().double()[:, None]
    bounds = [(s, min(s + rows_per_program, n_rows)) for s in range(0, n_rows, rows_per_program)]
    for got, v, what in ((dw.tensor, dy64 * x_hat, "dw"), (db.tensor, dy64, "db")):
        got, want = got.to("cpu", torch.float64), _run_sums(v, bounds)
        hint = (_dw_diagnose(got, v, n_rows, rows_per_program, block_m, what, dtype)
                or _dw_stride_hint(got, what, x, dy, mean, rstd, bounds)
                or _dw_input_hint(got, what, x64, dy64, mean.cpu().double(), rstd.cpu().double(), bounds) or DW_HINT)
        # a 16-bit accumulator, or 16-bit tile sums, can stay inside the tolerance: refused as such
        if _in_dtype(got, dtype) or _tile_sums_16bit(got, v, n_rows, rows_per_program, dtype):
            raise check.CheckFailure(f"{case}: {hint}")
        atol = 1e-4 * rows_per_program ** 0.5 * float(want.abs().max().clamp_min(1.0))
        for p in range(n_programs):  # every partial row: the sum of the program's own run of rows
            check.compare(f"{case}: {what}, partial row {p} (rows {bounds[p][0]} to {bounds[p][1] - 1})", got[p],
                          want[p], dtype=torch.float32, atol=atol, rtol=1e-4, hint=hint)
    xg.check(f"{case}, the input x")


def check_dw_db_kernel(kernel, name: str = "dw/db reduction over rows") -> None:
    """Judge ``kernel[(n_programs, cdiv(n_cols, BLOCK_N))](dw_partial_ptr, db_partial_ptr, x_ptr, dy_ptr, mean_ptr,
    rstd_ptr, n_rows, n_cols, x_row_stride, dy_row_stride, rows_per_program, BLOCK_M=, BLOCK_N=)``: each float32
    partial row must be float64's sum over its run of rows."""
    refuse(name, kernel)
    # (n_rows, n_cols, BLOCK_M, BLOCK_N, rows_per_program): most runs are not a whole number of tiles
    cases = env.pick(gpu=((50, 48, 16, 16, 24), (77, 100, 8, 32, 20), (1000, 4097, 32, 128, 100), (3, 1, 16, 16, 16),
                          (64, 40, 16, 32, 32)),
                     cpu=((50, 48, 16, 16, 24), (77, 100, 8, 32, 20), (300, 333, 16, 64, 40), (3, 1, 16, 16, 16),
                          (64, 40, 16, 32, 32)))
    for dtype in env.supported_dtypes():
        for n_rows, n_cols, block_m, block_n, rows_per_program in cases:
            _dw_case(kernel, n_rows, n_cols, dtype, block_m, block_n, rows_per_program)
    _dw_past_2_31(kernel, name)
    check.verdict(name, "every partial row is float64's sum over its own run of rows (runs ending inside a tile), "
                        "strided rows, no loads or writes outside the tensors " + LOADS_SEEN)


def _dw_past_2_31(kernel, name: str) -> None:
    """float16 x and dy whose last row starts past 2**31 elements (``offsets64.wide_rows``), runs of 2 rows
    in tiles of 2: rows * x_row_stride in int32 wraps at the last row, which then sums the padding."""
    n_cols, rows_per_program, block_m, block_n = 197, 2, 2, 64
    case = wide_case(name, n_cols) + f", BLOCK_M={block_m}, BLOCK_N={block_n}, rows_per_program={rows_per_program}"
    x_small, dy_small = (check.randn((3, n_cols), torch.float16, scale=2.0) for _ in range(2))
    x64, mean64, rstd64 = _stats64(x_small)
    mean, rstd = (s.float().to(x_small.device) for s in (mean64, rstd64))
    n_programs = triton.cdiv(3, rows_per_program)
    dw, db = (torch.full((n_programs, n_cols), float("nan"), device=x_small.device) for _ in range(2))
    signature = "It is launched as " + check_dw_db_kernel.__doc__.split("``")[1]

    def run(x, dy):
        x.copy_(x_small)
        dy.copy_(dy_small)
        wide_launch(lambda: kernel[(n_programs, triton.cdiv(n_cols, block_n))](
            dw, db, x, dy, mean, rstd, 3, n_cols, x.stride(0), dy.stride(0), rows_per_program, BLOCK_M=block_m,
            BLOCK_N=block_n), case, signature)

    with wide_rows(n_cols, ("x", "dy")) as t:
        if t is None:
            return
        run(t.pop("x"), t.pop("dy"))   # the views die with run: the memory goes back as the block ends
    dy64 = dy_small.to("cpu", torch.float64)
    x_hat = (x64 - mean.cpu().double()[:, None]) * rstd.cpu().double()[:, None]
    bounds = [(0, 2), (2, 3)]
    hint = ("a row offset computed in int32 wraps around past 2**31 elements (the rows from tl.program_id and "
            "tl.arange, and a row stride below 2**31, are int32): widen the rows before the product, "
            "rows.to(tl.int64) * x_row_stride (and * dy_row_stride)")
    for got, v, what in ((dw, dy64 * x_hat, "dw"), (db, dy64, "db")):
        check.compare(f"{case}: {what}_partial", got, _run_sums(v, bounds), dtype=torch.float32, atol=1e-3,
                      rtol=1e-4, hint=hint)
