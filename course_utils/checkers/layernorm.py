"""Checks for chapter 10 (LayerNorm forward row kernel, the dw/db reduction of the backward pass).

- :func:`check_forward_kernel` launches a student's one-row-per-program kernel
  ``kernel[(n_rows,)](y_ptr, x_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, n_cols, x_row_stride, y_row_stride,
  eps, BLOCK_SIZE=next_power_of_2(n_cols))`` and compares y, mean and rstd with float64.
- :func:`check_layer_norm_fn` judges a launcher ``fn(x, weight, bias, eps) -> y`` and counts its launches.
- :func:`check_dw_db_kernel` launches a student's stage-1 reduction
  ``kernel[(n_programs, cdiv(n_cols, BLOCK_N))](dw_partial_ptr, db_partial_ptr, x_ptr, dy_ptr, mean_ptr,
  rstd_ptr, n_rows, n_cols, x_row_stride, dy_row_stride, rows_per_program, BLOCK_M=..., BLOCK_N=...)``
  and compares the sums of its partial rows with float64.

Every call draws fresh inputs: odd row lengths; rows read through a row stride wider than the row
(the gap holds +/-3e4, so reading past a row changes the answer); every other row sits on a large
constant OFFSET (1000 with a spread of 1: E[x^2] - E[x]^2 cancels there in float32, and 16-bit sums
overflow); outputs poisoned with NaN inside guard zones. When a check fails it says which known
mistake the numbers look like (no mean subtracted, one-pass variance, 16-bit statistics, wrong axis).
"""

from __future__ import annotations

import torch
import triton

from .. import check, env

OFFSET = 1000.0
EPS = 1e-5
F32_EPS = float(torch.finfo(torch.float32).eps)
FWD_HINT = ("compute in float32 (x.to(tl.float32)): mean = sum(x) / n_cols, then the variance of the centered "
            "values (x - mean, with masked lanes set to 0), rstd = 1 / sqrt(var + eps); store mean and rstd.")


def _inputs(n_rows: int, n_cols: int, dtype, gap: int = 5):
    """x (n_rows, n_cols) in a guarded (n_rows, n_cols + gap) buffer; even rows around OFFSET."""
    full = check.randn((n_rows, n_cols + gap), dtype, scale=3.0, outliers=0.02, outlier_scale=50.0)
    offset_rows = check.randn((n_rows, n_cols + gap), dtype, scale=1.0, offset=OFFSET)
    full[::2] = offset_rows[::2]
    if gap:
        junk = torch.where(torch.rand(n_rows, gap, device=full.device) < 0.5, 3e4, -3e4)
        full[:, n_cols:] = junk.to(dtype)
    g = check.guarded_copy(full)
    return g, g.tensor[:, :n_cols]


def _stats64(x: torch.Tensor):
    x64 = x.to("cpu", torch.float64)
    mean = x64.mean(-1)
    var = ((x64 - mean[:, None]) ** 2).mean(-1)
    return x64, mean, 1.0 / torch.sqrt(var + EPS)


def _rel(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    g = got.to("cpu", torch.float64)
    return ((g - want).abs() / want.abs().clamp_min(1e-12)).nan_to_num(float("inf"))


def rstd_rtol(mean64: torch.Tensor, rstd64: torch.Tensor, n_cols: int) -> torch.Tensor:
    """Per row, how far a right float32 two-pass rstd can be from float64's (relative).

    The float32 mean is off by about log2(N) roundings of |mean|, d; subtracting it leaves (x - mean)
    off by d on every element, so the variance is off by about d^2 (plus log2(N) roundings of var).
    rstd = 1 / sqrt(var + eps) moves by half that, relative to var + eps: on a row near 1000 whose
    16-bit values are nearly all equal (var near 0), that is 1e-4 and more, not a mistake.
    """
    k = max(1, n_cols.bit_length())
    var = 1.0 / rstd64 ** 2 - EPS
    dvar = (k * F32_EPS * mean64.abs()) ** 2 + k * F32_EPS * var.abs()
    return 1e-4 + 0.5 * dvar / (var + EPS)


def diagnose_stats(mean: torch.Tensor, rstd: torch.Tensor, x: torch.Tensor) -> str:
    """Which known mistake the statistics a kernel stored look like ("" when none fits)."""
    x64, mean64, rstd64 = _stats64(x)
    if bool(torch.isfinite(mean.cpu()).all()) and bool(torch.isnan(rstd.cpu()).any()):
        return ("rstd is NaN: the variance came out negative, which sum(x^2)/n - mean^2 (the one-pass variance) "
                "does on rows around 1000, where it subtracts two numbers near 1e6 in float32. Subtract the mean "
                "first, then sum the squares (the row is in registers: the second pass is free).")
    if not bool(torch.isfinite(mean.cpu()).all() and torch.isfinite(rstd.cpu()).all()):
        return ("some statistics are inf or NaN where the float64 ones are finite. If you summed in 16 bits "
                "(float16/bfloat16 statistics), the sum of a row around 1000 overflows (largest float16: 65504): "
                "convert x with x.to(tl.float32) before the sums.")
    n = x.shape[-1]
    block = triton.next_power_of_2(n)
    if n != block and bool((_rel(mean, mean64 * n / block) < 1e-4).all()):
        return "the mean was divided by BLOCK_SIZE; divide by n_cols (masked lanes are not part of the row)."
    no_mean = 1.0 / torch.sqrt((x64 ** 2).mean(-1) + EPS)
    if bool((_rel(rstd, no_mean) < 1e-3).all()):
        return ("rstd matches 1 / sqrt(mean(x^2) + eps): the variance was computed without subtracting the mean. "
                "var = sum((x - mean)^2) / n_cols.")
    bad = _rel(rstd, rstd64) > rstd_rtol(mean64, rstd64, n)
    if x.shape[0] > 1 and bool(bad[0::2].any()) and not bool(bad[1::2].any()) and \
            bool((_rel(mean, mean64) < 1e-5).all()):
        return ("rstd is wrong only on the rows around 1000 (the even rows), where sum(x^2)/n - mean^2 subtracts "
                "two numbers near 1e6 in float32 and keeps only noise: the one-pass variance. Subtract the mean "
                "first, then sum the squares (the row is in registers: the second pass is free).")
    if bool((_rel(mean, mean64) < 1e-2).all()) and bool((_rel(rstd, rstd64) < 5e-2).all()):
        return ("the statistics are close but not float32-accurate: are they computed in 16 bits (float16/bfloat16 "
                "statistics)? Accumulate the sums in float32.")
    if n > 1 and bool(bad.any()):
        return ("rstd is wrong: do masked lanes add to the variance? Lanes past n_cols hold 0, and 0 - mean is not 0: "
                "use tl.where(mask, x - mean, 0.0).")
    return ""


def _launch(what, fn, case, hint):
    try:
        fn()
    except NotImplementedError:
        raise
    except check.CheckFailure:
        raise
    except Exception as e:  # a crash in the student's kernel: say where
        raise check.CheckFailure(f"{case}: your kernel raised {type(e).__name__}: {str(e)[:400]}\n{what}"
                                 + (f"\nHint: {hint}" if hint else "")) from e


def _y_atol(dtype, n_cols, mean64, rstd64, w) -> float:
    """y's tolerance: the dtype's, plus what float32 statistics cannot avoid on offset rows (the mean is
    known to about log2(N) float32 roundings of |mean|, and y = (x - mean) * rstd * w magnifies it)."""
    cond = float((mean64.abs() * rstd64).max()) * float(w.abs().max())
    return check.tolerance(dtype)[0] + max(1.0, n_cols.bit_length()) * F32_EPS * cond


def check_forward_kernel(kernel, name: str = "LayerNorm forward, one row per program") -> None:
    """Judge a one-row-per-program LayerNorm forward kernel (y, mean and rstd against float64)."""
    shapes = env.pick(gpu=((1, 1), (7, 13), (37, 1000), (5, 4097), (4, 12345)),
                      cpu=((1, 1), (7, 13), (37, 300), (6, 1000)))
    signature = ("It is launched as kernel[(n_rows,)](y_ptr, x_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, n_cols, "
                 "x_row_stride, y_row_stride, eps, BLOCK_SIZE=triton.next_power_of_2(n_cols)).")
    for dtype in env.supported_dtypes():
        for n_rows, n_cols in shapes:
            case = f"{name} ({str(dtype).removeprefix('torch.')}, {n_rows} rows x {n_cols} cols)"
            xg, x = _inputs(n_rows, n_cols, dtype)
            w = check.randn((n_cols,), dtype, scale=0.5, offset=1.0)
            b = check.randn((n_cols,), dtype)
            before = x.clone()
            y = check.Guarded((n_rows, n_cols), dtype)
            mean = check.Guarded((n_rows,), torch.float32)
            rstd = check.Guarded((n_rows,), torch.float32)
            _launch(signature, lambda: kernel[(n_rows,)](y.tensor, x, w, b, mean.tensor, rstd.tensor, n_cols,  # noqa: B023
                                                         x.stride(0), y.tensor.stride(0), EPS,
                                                         BLOCK_SIZE=triton.next_power_of_2(n_cols)), case, FWD_HINT)
            for g, what in ((y, "y"), (mean, "mean"), (rstd, "rstd")):
                g.check(f"{case}, {what}", "store y with mask=offsets < n_cols, and one mean and one rstd per row "
                                           "at mean_ptr + pid and rstd_ptr + pid")
            x64, mean64, rstd64 = _stats64(before)
            hint = diagnose_stats(mean.tensor, rstd.tensor, before) or FWD_HINT
            check.compare(f"{case}: mean", mean.tensor, mean64, dtype=torch.float32, atol=1e-4, rtol=1e-5, hint=hint)
            rtol = rstd_rtol(mean64, rstd64, n_cols)
            off = _rel(rstd.tensor, rstd64) > rtol
            if bool(off.any()):  # the first row off, named by check.compare at that row's own tolerance
                row = int(off.nonzero()[0])
                check.compare(f"{case}: rstd (row {row})", rstd.tensor[row:row + 1], rstd64[row:row + 1],
                              dtype=torch.float32, atol=0.0, rtol=float(rtol[row]), hint=hint)
            y64 = (x64 - mean64[:, None]) * rstd64[:, None] * w.cpu().double() + b.cpu().double()
            check.compare(f"{case}: y", y.tensor, y64, dtype=dtype, atol=_y_atol(dtype, n_cols, mean64, rstd64, w),
                          hint="y = (x - mean) * rstd * w + b, stored in y's dtype (y.to(y_ptr.dtype.element_ty)).")
            xg.check(f"{case}, the input buffer")
            if not torch.equal(x, before):
                raise check.CheckFailure(f"{case}: your kernel changed its input; it must only write y, mean, rstd")
    check.verdict(name, "y, mean and rstd match float64 on every shape and dtype tried, rows around 1000, "
                        "strided rows, no writes outside the outputs")


def check_layer_norm_fn(fn, name: str = "layer_norm") -> None:
    """Judge ``fn(x, weight, bias, eps) -> y`` on a 2-D input and count its kernel launches (one)."""
    n_rows, n_cols = env.pick(gpu=(123, 1999), cpu=(9, 777))
    _, x = _inputs(n_rows, n_cols, torch.float32, gap=0)
    x = x.contiguous()
    w, b = check.randn((n_cols,), scale=0.5, offset=1.0), check.randn((n_cols,))
    try:
        y = fn(x, w, b, EPS)
    except NotImplementedError:
        raise
    except Exception as e:
        raise check.CheckFailure(f"{name}: your function raised {type(e).__name__}: {str(e)[:400]}") from e
    x64, mean64, rstd64 = _stats64(x)
    y64 = (x64 - mean64[:, None]) * rstd64[:, None] * w.cpu().double() + b.cpu().double()
    check.compare(name, y, y64, dtype=x.dtype, atol=_y_atol(x.dtype, n_cols, mean64, rstd64, w), hint=FWD_HINT)
    check.check_kernel_launches(name, fn, x, w, b, EPS, expected=1)
    check.verdict(name, "matches float64 LayerNorm in one kernel launch")


# --------------------------------------------------------------------------- the dw/db reduction

DW_HINT = ("program (pid_m, pid_n) sums over ITS rows [pid_m * rows_per_program, ...) only (never past n_rows), "
           "for the columns pid_n * BLOCK_N + tl.arange(0, BLOCK_N): dw += tl.sum(dy * x_hat, axis=0) and "
           "db += tl.sum(dy, axis=0) over tiles of BLOCK_M rows, with x_hat = (x - mean) * rstd; it stores row pid_m "
           "of dw_partial and db_partial (row length n_cols).")


def _dw_case(kernel, n_rows, n_cols, dtype, block_m, block_n, rows_per_program):
    case = (f"dw/db reduction ({str(dtype).removeprefix('torch.')}, {n_rows} rows x {n_cols} cols, BLOCK_M={block_m}, "
            f"BLOCK_N={block_n}, rows_per_program={rows_per_program})")
    xg, x = _inputs(n_rows, n_cols, dtype)
    dy = check.randn((n_rows, n_cols + 3), dtype)[:, :n_cols]  # strided too
    x64, mean64, rstd64 = _stats64(x)
    mean, rstd = mean64.float().to(x.device), rstd64.float().to(x.device)
    n_programs = triton.cdiv(n_rows, rows_per_program)
    dw = check.Guarded((n_programs, n_cols), torch.float32)
    db = check.Guarded((n_programs, n_cols), torch.float32)
    grid = (n_programs, triton.cdiv(n_cols, block_n))
    signature = ("It is launched as kernel[(n_programs, triton.cdiv(n_cols, BLOCK_N))](dw_partial_ptr, db_partial_ptr, "
                 "x_ptr, dy_ptr, mean_ptr, rstd_ptr, n_rows, n_cols, x_row_stride, dy_row_stride, rows_per_program, "
                 "BLOCK_M=..., BLOCK_N=...).\nIf the error is about shapes: dw and db hold one sum per column "
                 "(BLOCK_N values); tl.sum(tile, axis=1) gives one per row (BLOCK_M values): reduce over axis 0.")
    _launch(signature, lambda: kernel[grid](dw.tensor, db.tensor, x, dy, mean, rstd, n_rows, n_cols, x.stride(0),
                                            dy.stride(0), rows_per_program, BLOCK_M=block_m, BLOCK_N=block_n),
            case, DW_HINT)
    for g, what in ((dw, "dw_partial"), (db, "db_partial")):
        g.check(f"{case}, {what}", "mask the columns of the last block: cols < n_cols")
    dy64 = dy.to("cpu", torch.float64)
    x_hat = (x64 - mean.cpu().double()[:, None]) * rstd.cpu().double()[:, None]
    for got, want, what in ((dw.tensor, (dy64 * x_hat).sum(0), "dw"), (db.tensor, dy64.sum(0), "db")):
        total = got.to("cpu", torch.float64).sum(0)
        hint = DW_HINT
        if block_m == block_n and n_cols % block_n == 0 and bool(torch.isfinite(total).all()):
            same_total = abs(float(total.sum() - want.sum())) <= 1e-3 * max(1.0, float(want.abs().sum()))
            if same_total and not bool(torch.allclose(total, want, rtol=1e-3, atol=1e-2)):
                hint = ("the grand total of your sums is right but not the sum of each column: " + what +
                        " is summed over the wrong axis. tl.sum(tile, axis=1) adds up a row of the tile; " + what +
                        "[j] is a sum over the rows, tl.sum(tile, axis=0).")
        atol = 1e-4 * n_rows ** 0.5 * float(want.abs().max().clamp_min(1.0))
        check.compare(f"{case}: {what} (the partial rows added up)", total, want, dtype=torch.float32, atol=atol,
                      rtol=1e-4, hint=hint)
    xg.check(f"{case}, the input x")


def check_dw_db_kernel(kernel, name: str = "dw/db reduction over rows") -> None:
    """Judge a stage-1 dw/db kernel: the float32 partial rows it writes must add up to float64's sums."""
    cases = env.pick(gpu=((50, 48, 16, 16, 32), (77, 100, 8, 32, 24), (1000, 4097, 32, 128, 256), (3, 1, 16, 16, 16)),
                     cpu=((50, 48, 16, 16, 32), (77, 100, 8, 32, 24), (300, 333, 16, 64, 64), (3, 1, 16, 16, 16)))
    for dtype in env.supported_dtypes():
        for n_rows, n_cols, block_m, block_n, rows_per_program in cases:
            _dw_case(kernel, n_rows, n_cols, dtype, block_m, block_n, rows_per_program)
    check.verdict(name, "the partial sums add up to float64's dw and db on every shape and dtype tried, "
                        "strided rows, no writes outside the partial buffers")
