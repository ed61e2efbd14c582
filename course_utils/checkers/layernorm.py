"""Checks for chapter 10: the LayerNorm forward row kernel and its launcher, the dw/db stage-1 reduction
(every partial row compared) and RMSNorm's dx with rstd recomputed; each docstring gives the launch.
(Over 350 lines: chapter 10's exercises share the statistics' fault diagnosis (which mistake a kernel's mean and
rstd look like), read by the forward, Welford and backward checks alike.)
Fresh inputs every call: odd row lengths; strided rows (the gap holds +/-3e4); every other row around
OFFSET = 1000 (E[x^2] - E[x]^2 cancels in float32, 16-bit sums overflow); one row in four with a variance
below the non-default ``eps`` every check passes; NaN-poisoned outputs in guard zones; loads outside the
inputs recorded under the interpreter; the course's kernels, launchers and torch's norms refused as answers.
Under the interpreter the loads also show a tensor's rows read with another tensor's stride (named), and, for
the forward in chunks (exercise 10.1, Welford's statistics), how many times the kernel reads each element of
x: one pass for the statistics and one for y, where a mean pass, a variance pass and a y pass read it three
times (the numbers alone cannot tell the methods apart: both are float32-accurate).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from .. import check, env

OFFSET = 1000.0
EPS = 1e-3      # the eps every check passes: not a default of any norm, and above the small rows' variance
SMALL = 0.01    # spread of the small rows (one in four): variance 1e-4 < EPS
F32_EPS = float(torch.finfo(torch.float32).eps)
ROWS_GPU = ((7, 13), (1, 1), (37, 1000), (5, 4097), (4, 12345))  # 7x13 first: names faults (1 col: rounding)
FWD_HINT = ("compute in float32 (x.to(tl.float32)): mean = sum(x) / n_cols, then the variance of the centered "
            "values (x - mean, with masked lanes set to 0), rstd = 1 / sqrt(var + eps); store mean and rstd.")
CHUNK_HINT = ("Welford's statistics, in float32, in one pass over the row: each chunk's count n_b (its lanes inside "
              "the row), mean m_b and M2_b = sum((x - m_b)^2) over those lanes, merged with Chan's formula (delta = "
              "m_b - m_a, taken before the mean moves); var = M2 / n_cols, rstd = 1 / sqrt(var + eps); then a second "
              "pass over the chunks writes y.")
#: exercise 10.1: reads of each element of x, the statistics' pass and y's
CHUNK_PASSES = 2


def answers() -> dict:
    """The course's answers a check refuses: kernels, launchers, references, and torch's own norms."""
    from ..kernels import layernorm as L
    from ..tuned import layernorm as T
    from ..tuned import layernorm_kernels as TK
    names = ("L.layer_norm_fwd_kernel L.rms_norm_fwd_kernel L.norm_bwd_dx_kernel L.norm_dw_db_kernel "
             "L.column_sum_kernel L.layer_norm_teaching L.rms_norm_teaching L.layer_norm_backward_teaching "
             "L.rms_norm_backward_teaching L.layer_norm_ref L.rms_norm_ref T.layer_norm T.rms_norm T._forward "
             "T.layer_norm_backward T.rms_norm_backward T._backward TK.norm_fwd_kernel TK.norm_bwd_kernel "
             "TK.norm_bwd_chunked_kernel F.layer_norm F.rms_norm torch.layer_norm torch.native_layer_norm")
    where = {"L": L, "T": T, "TK": TK, "F": F, "torch": torch}
    return {f"{n} (the answer key)": getattr(where[n.split(".")[0]], n.split(".")[1]) for n in names.split()}


def refuse(what: str, fn) -> None:
    """Refuse the course's answers handed in as ``fn``, or called from it (a kernel's body included)."""
    for f in (fn, getattr(fn, "fn", None)):  # a @triton.jit kernel: also the Python function it compiles
        check.refuse_answer_key(what, f, answers())


def _inputs(n_rows: int, n_cols: int, dtype, gap: int = 5):
    """x (n_rows, n_cols) in a guarded (n_rows, n_cols + gap) buffer; even rows around OFFSET, rows 3, 7... small."""
    full = check.randn((n_rows, n_cols + gap), dtype, scale=3.0, outliers=0.02, outlier_scale=50.0)
    full[::2] = check.randn((n_rows, n_cols + gap), dtype, scale=1.0, offset=OFFSET)[::2]
    full[3::4] = check.randn((n_rows, n_cols + gap), dtype, scale=SMALL)[3::4]
    if gap:
        full[:, n_cols:] = torch.where(torch.rand(n_rows, gap, device=full.device) < 0.5, 3e4, -3e4).to(dtype)
    g = check.guarded_copy(full)
    return g, g.tensor[:, :n_cols]


def _stats64(x: torch.Tensor, eps: float = EPS):
    x64 = x.to("cpu", torch.float64)
    mean = x64.mean(-1)
    return x64, mean, 1.0 / torch.sqrt(((x64 - mean[:, None]) ** 2).mean(-1) + eps)


def _rel(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    g = got.to("cpu", torch.float64)
    return ((g - want).abs() / want.abs().clamp_min(1e-12)).nan_to_num(float("inf"))


def rstd_rtol(mean64: torch.Tensor, rstd64: torch.Tensor, n_cols: int, eps: float = EPS) -> torch.Tensor:
    """Per row, how far a right float32 two-pass rstd can be from float64's (relative): the float32 mean is
    off by about log2(N) roundings of |mean|, d, so the variance by about d^2 (plus log2(N) roundings of var);
    rstd = 1 / sqrt(var + eps) moves by half that, relative to var + eps."""
    k = max(1, n_cols.bit_length())  # roundings
    var = 1.0 / rstd64 ** 2 - eps
    dvar = (k * F32_EPS * mean64.abs()) ** 2 + k * F32_EPS * var.abs()
    return 1e-4 + 0.5 * dvar / (var + eps)


EPS_HINT = (f"the small rows (variance about {SMALL ** 2:g}) come out as if eps were 1e-5, 1e-6 or 0: the check "
            f"passes eps={EPS:g}. Use the eps argument: rstd = 1 / sqrt(var + eps).")


def _chan_m2(x64: torch.Tensor, block: int, late_delta: bool = False) -> torch.Tensor:
    """M2 per row from Welford chunks merged with Chan's formula, in float64; ``late_delta``: the delta^2 term
    taken from the mean after its update (m_b - m), the usual slip."""
    count, mean, m2 = 0, torch.zeros_like(x64[:, 0]), torch.zeros_like(x64[:, 0])
    for c in x64.split(block, -1):
        n_b, m_b = c.shape[-1], c.mean(-1)
        total = count + n_b
        delta = m_b - mean
        mean = mean + delta * n_b / total
        d2 = (m_b - mean) if late_delta else delta
        m2 = m2 + ((c - m_b[:, None]) ** 2).sum(-1) + d2 * d2 * count * n_b / total
        count = total
    return m2


def diagnose_stats(mean: torch.Tensor, rstd: torch.Tensor, x: torch.Tensor, eps: float = EPS, block=None) -> str:
    """Which known mistake the statistics a kernel stored look like ("" when none fits)."""
    x64, mean64, rstd64 = _stats64(x, eps)
    if bool(torch.isfinite(mean.cpu()).all()) and bool(torch.isnan(rstd.cpu()).any()):
        return ("rstd is NaN: the variance came out negative, as sum(x^2)/n - mean^2 (the one-pass variance) does "
                "on rows around 1000 in float32. Subtract the mean first, then sum the squares.")
    if not bool(torch.isfinite(mean.cpu()).all() and torch.isfinite(rstd.cpu()).all()):
        return ("some statistics are inf or NaN: a 16-bit sum of a row around 1000 overflows (largest float16: "
                "65504): convert x with x.to(tl.float32) before the sums.")
    n = x.shape[-1]
    block = block or triton.next_power_of_2(n)
    if n < block and bool((_rel(mean, mean64 * n / block) < 1e-4).all()):
        return "the mean counts BLOCK_SIZE lanes (a whole block, or a partial last chunk as full): divide by n_cols."
    no_mean = 1.0 / torch.sqrt((x64 ** 2).mean(-1) + eps)
    if bool((_rel(rstd, no_mean) < 1e-3).all()):
        return ("rstd matches 1 / sqrt(mean(x^2) + eps): the variance was computed without subtracting the mean. "
                "var = sum((x - mean)^2) / n_cols.")
    small, var64 = slice(3, None, 4), 1.0 / rstd64 ** 2 - eps
    near = lambda want: bool((_rel(rstd, want) <= 2 * rstd_rtol(mean64, rstd64, n, eps)).all())  # noqa: E731
    right = near(rstd64)
    if not right and (near(1.0 / (var64.sqrt() + eps)) or near(1.0 / var64.sqrt() + eps)):
        return ("eps is outside the square root (the small rows, variance about "
                f"{SMALL ** 2:g}, show it): rstd = 1 / sqrt(var + eps), eps added to the variance.")
    if not right and block < n and near((_chan_m2(x64, block, late_delta=True) / n + eps) ** -0.5):
        return ("Chan's merge takes delta from the mean after its update: delta = m_b - m_a must be computed before "
                "m_a moves (m = m_a + delta * n_b / n), and the same delta goes into M2's delta^2 * n_a * n_b / n.")
    if x.shape[0] > 3 and any(bool((_rel(rstd[small], 1 / (var64[small] + e).sqrt()) < 2e-2).all())
                              for e in (1e-5, 1e-6, 0)):
        return EPS_HINT
    bad = _rel(rstd, rstd64) > rstd_rtol(mean64, rstd64, n, eps)
    if x.shape[0] > 1 and bool(bad[0::2].any()) and not bool(bad[1::2].any()) and \
            bool((_rel(mean, mean64) < 1e-5).all()):
        return ("rstd is wrong only on the rows around 1000 (the even rows), where sum(x^2)/n - mean^2 keeps only "
                "float32 noise: the one-pass variance. Subtract the mean first, then sum the squares.")
    m2_chunks = sum(((c - c.mean(-1, keepdim=True)) ** 2).sum(-1) for c in x64.split(block, -1))  # Chan's delta^2 lost
    if block < n and bool((_rel(rstd, (m2_chunks / n + eps) ** -0.5) < 1e-3).all()):
        return "rstd is the chunks' own M2 summed: Chan's merge lost its delta^2 * n_a * n_b / n term."
    if bool(((r := _rel(mean, mean64)) < 1e-2).all() and ((r > 1e-5).any() or (_rel(rstd, rstd64) < 5e-2).all())):
        return ("the statistics are close but not float32-accurate: are they computed in 16 bits (float16/bfloat16 "
                "statistics)? Accumulate the sums in float32.")
    if n % block and bool(bad.any()):
        return ("rstd is wrong: do masked lanes add to the variance? Lanes past n_cols hold 0, and 0 - mean is not 0: "
                "use tl.where(mask, x - mean, 0.0).")
    return ""


def _stride_fault(loads, rows: dict, strides: dict) -> str:
    """'' unless a 2-D input of ``rows`` (``{name: tensor}``) was read with another row stride: every element
    address that stride gives was loaded, and not every one of the tensor's own. ``strides``: the kernel's
    stride and length arguments, ``{argument: value}``."""
    import numpy as np
    loaded = loads.flat()
    for name, t in rows.items():
        r, c = (np.arange(n, dtype=np.int64) for n in t.shape)
        own = t.stride(0)
        addresses = lambda st: (t.data_ptr() + (r[:, None] * st + c[None, :]) * t.element_size()).ravel()  # noqa: E731,B023
        if t.shape[0] < 2 or bool(np.isin(addresses(own).astype(np.uint64), loaded).all()):
            continue
        for other in dict.fromkeys(strides.values()):
            if other != own and bool(np.isin(addresses(other).astype(np.uint64), loaded).all()):
                arg = " and of ".join(a for a, v in strides.items() if v == other)
                return (f"your kernel reads the rows of {name} {other} elements apart, the value of {arg}; {name}'s "
                        f"rows are {own} apart: address row r of {name} as {name}_ptr + r * {name}_row_stride. Each "
                        "tensor has its own row stride.")
    return ""


def _launch(what, fn, case, hint, inputs=(), rows=None, strides=None):
    """Run the student's launch under load tracking; a crash, a load outside ``inputs`` or an input's rows read
    with another tensor's stride (``rows``: ``{name: tensor}``, ``strides``: ``{argument: value}``) fails, named."""
    from .loads import interpreter_limit
    try:
        with check.track_loads() as loads:
            fn()
    except (NotImplementedError, check.CheckFailure):
        raise
    except Exception as e:  # a crash in the student's kernel: say where
        limit = interpreter_limit(e)
        if limit:
            raise check.CheckFailure(f"{case}: {limit}") from e
        raise check.CheckFailure(f"{case}: your kernel raised {type(e).__name__}: {str(e)[:400]}\n{what}"
                                 + (f"\nHint: {hint}" if hint else "")) from e
    fault = _stride_fault(loads, rows, strides) if rows and loads.active else ""
    if fault:
        raise check.CheckFailure(f"{case}: {fault}")
    check.check_loads_inside(case, loads, list(inputs))
    return loads


def _y_atol(dtype, n_cols, mean64, rstd64, w) -> float:
    """y's tolerance: the dtype's, plus log2(N) float32 roundings of |mean| (offset rows) times rstd * |w|."""
    cond = float((mean64.abs() * rstd64).max()) * float(w.abs().max())
    return check.tolerance(dtype)[0] + max(1.0, n_cols.bit_length()) * F32_EPS * cond


def _check_passes(case: str, loads, x: torch.Tensor, chunk) -> None:
    """Exercise 10.1 (``chunk``): the statistics in one pass over the row, y in a second (interpreter only)."""
    from .loads import reads_per_element
    if not chunk or not loads.active or x.shape[1] <= chunk:
        return
    reads = reads_per_element(loads, x)
    if reads > CHUNK_PASSES + 0.01:
        raise check.CheckFailure(
            f"{case}: your kernel reads each element of x {reads:.2f} times; Welford's method reads it "
            f"{CHUNK_PASSES} times: one pass over the row for the statistics (each chunk's count, mean and M2, "
            "merged into the row's with Chan's formula) and one that writes y. A pass for the mean and another "
            "for the variance is the two-pass method, a third read of the row.")


def check_forward_kernel(kernel, name: str = "LayerNorm forward, one row per program", *, chunk=None) -> None:
    """Judge ``kernel[(n_rows,)](y_ptr, x_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, n_cols, x_row_stride,
    y_row_stride, eps, BLOCK_SIZE=next_power_of_2(n_cols) or chunk)``: y, mean and rstd against float64.
    With ``chunk``, BLOCK_SIZE is that (rows longer than a block: the kernel loops over chunks of the row)."""
    refuse(name, kernel)
    shapes = env.pick(gpu=ROWS_GPU, cpu=((7, 13), (1, 1), (37, 300), (6, 1000)))
    signature = "It is launched as " + check_forward_kernel.__doc__.split("``")[1]
    for dtype in env.supported_dtypes():
        for n_rows, n_cols in shapes:
            case = f"{name} ({str(dtype).removeprefix('torch.')}, {n_rows} rows x {n_cols} cols, eps={EPS:g})"
            xg, x = _inputs(n_rows, n_cols, dtype)
            w = check.randn((n_cols,), dtype, scale=0.5, offset=1.0)
            b = check.randn((n_cols,), dtype)
            before = x.clone()
            y = check.Guarded((n_rows, n_cols), dtype)
            mean = check.Guarded((n_rows,), torch.float32)
            rstd = check.Guarded((n_rows,), torch.float32)
            block = chunk or triton.next_power_of_2(n_cols)
            fwd_hint = CHUNK_HINT if chunk else FWD_HINT
            loads = _launch(signature, lambda: kernel[(n_rows,)](y.tensor, x, w, b, mean.tensor, rstd.tensor,  # noqa: B023
                                                                 n_cols, x.stride(0), y.tensor.stride(0), EPS,
                                                                 BLOCK_SIZE=block), case, fwd_hint, (x, w, b),
                            {"x": x}, {"y_row_stride": y.tensor.stride(0), "n_cols": n_cols})
            check.require(not loads.widths or max(loads.widths) <= block, f"{case}: your kernel loads "
                          f"{max(loads.widths or [0])} lanes at once, launched with BLOCK_SIZE={block}: loop over "
                          "the row in chunks of tl.arange(0, BLOCK_SIZE).")
            for g, what in ((y, "y"), (mean, "mean"), (rstd, "rstd")):
                g.check(f"{case}, {what}", "mask the store of y; one mean and one rstd per row, at pid")
            x64, mean64, rstd64 = _stats64(before)
            hint = diagnose_stats(mean.tensor, rstd.tensor, before, block=block) or fwd_hint
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
            _check_passes(case, loads, x, chunk)
    check.verdict(name, "y, mean and rstd match float64: rows around 1000, small rows (eps matters), strided rows, "
                        "no loads or writes outside the tensors")


def check_layer_norm_fn(fn, name: str = "layer_norm") -> None:
    """Judge ``fn(x, weight, bias, eps) -> y`` on a 2-D input and count its kernel launches (one)."""
    refuse(name, fn)
    n_rows, n_cols = env.pick(gpu=(123, 1999), cpu=(9, 777))
    x = _inputs(n_rows, n_cols, torch.float32, gap=0)[1].contiguous()
    w, b = check.randn((n_cols,), scale=0.5, offset=1.0), check.randn((n_cols,))
    try:
        y = fn(x, w, b, EPS)
    except NotImplementedError:
        raise
    except Exception as e:
        raise check.CheckFailure(f"{name}: your function raised {type(e).__name__}: {str(e)[:400]}") from e
    x64, mean64, rstd64 = _stats64(x)
    y64 = (x64 - mean64[:, None]) * rstd64[:, None] * w.cpu().double() + b.cpu().double()
    check.compare(name, y, y64, dtype=x.dtype, atol=_y_atol(x.dtype, n_cols, mean64, rstd64, w),
                  hint=f"pass eps (the check uses eps={EPS:g}) and x's row stride on to the kernel, one program "
                       "per row; the kernel's own check (exercise 10.1's first check) judges its statistics.")
    check.check_kernel_launches(name, fn, x, w, b, EPS, expected=1)
    check.verdict(name, "matches float64 LayerNorm in one kernel launch")


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


def _dw_diagnose(got, v, n_rows, rows_per_program, block_m, what, dtype=torch.float32) -> str:
    """Which mistake the partial rows look like, from sums over other row ranges ("" when none fits)."""
    tiles, total = triton.cdiv(rows_per_program, block_m) * block_m, v.sum(0)
    close = lambda a, b: bool(torch.allclose(a, b, rtol=1e-3, atol=1e-2 * float(b.abs().max().clamp_min(1))))  # noqa: E731
    if not bool(torch.isfinite(got).all()):
        return ""
    if _in_dtype(got, dtype):
        name = str(dtype).removeprefix("torch.")
        return (f"every partial {what} sum is a {name} number: the sums were accumulated (or rounded) in the input's "
                f"dtype, {name}, whose rounding (about {torch.finfo(dtype).eps:.0e} of the sum) the check sees. "
                f"Accumulate in float32: {what} = tl.zeros((BLOCK_N,), dtype=tl.float32), adding float32 values.")
    if tiles != rows_per_program and close(got, _run_sums(v, [(s, min(s + tiles, n_rows)) for s in
                                                              range(0, n_rows, rows_per_program)])):
        return (f"each partial {what} row also holds the rows of the next run that its last tile covers: the rows of "
                "a tile were masked with rows < n_rows, so the next program counts them again. A tile's rows end at "
                "the run's end, end = min(first + rows_per_program, n_rows): mask with rows < end.")
    for want, which in ((total[None].expand_as(got), "every partial row"), (torch.cat([total[None], 0 * got[1:]]),
                                                                           "partial row 0 (the others 0)")):
        if close(got, want):
            return f"{which} holds the {what} sum of ALL rows: each program sums only its own run of rows."
    if close(got.sum(0), total):
        return (f"the partial {what} rows add up to the right sums but are not each run's own: program pid_m stores "
                "the sum over rows [pid_m * rows_per_program, ...) in row pid_m.")
    if close(got.sum(0).sum(), total.sum()):
        return (f"the grand total of your sums is right but not the sum of each column: {what} is summed over the "
                f"wrong axis. tl.sum(tile, axis=1) adds up a row of the tile; {what}[j] is tl.sum(tile, axis=0).")
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
    dy64 = dy.to("cpu", torch.float64)
    x_hat = (x64 - mean.cpu().double()[:, None]) * rstd.cpu().double()[:, None]
    bounds = [(s, min(s + rows_per_program, n_rows)) for s in range(0, n_rows, rows_per_program)]
    for got, v, what in ((dw.tensor, dy64 * x_hat, "dw"), (db.tensor, dy64, "db")):
        got, want = got.to("cpu", torch.float64), _run_sums(v, bounds)
        hint = _dw_diagnose(got, v, n_rows, rows_per_program, block_m, what, dtype) or DW_HINT
        if _in_dtype(got, dtype):   # a 16-bit accumulator can stay inside the tolerance: refused as such
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
    check.verdict(name, "every partial row is float64's sum over its own run of rows (runs ending inside a tile), "
                        "strided rows, no loads or writes outside the tensors")


# --------------------------------------------------------------------------- RMSNorm's backward, rstd recomputed

RMS_HINT = ("recompute rstd = 1 / sqrt(sum(x * x) / n_cols + eps) in float32; with x_hat = x * rstd and g = dy * w, "
            "dx = (g - x_hat * sum(g * x_hat) / n_cols) * rstd (RMSNorm has no mean: no mean(g) term).")


def _rms_dx64(x64, dy64, w64, eps, *, layer_norm=False, c1=True, n=None):
    """dx of RMSNorm in float64 (``layer_norm``/``c1``/``n``: the known wrong formulas, to name them)."""
    n = n or x64.shape[-1]
    xc = x64 - x64.mean(-1, keepdim=True) if layer_norm else x64
    rstd = 1.0 / torch.sqrt((xc * xc).sum(-1, keepdim=True) / n + eps)
    x_hat, g = xc * rstd, dy64 * w64
    dx = g - (x_hat * (g * x_hat).sum(-1, keepdim=True) / n if c1 else 0.0)
    return (dx - g.mean(-1, keepdim=True) if layer_norm else dx) * rstd


def _read_with_stride(t: torch.Tensor, stride: int) -> torch.Tensor:
    """The rows of the 2-D ``t`` as a kernel reads them with another row ``stride``, in float64, as many as stay
    inside ``t``'s own elements (row 0 included, which any stride reads right)."""
    n_rows, n_cols = t.shape
    last = (n_rows - 1) * t.stride(0) + n_cols       # one past t's last element
    flat = t.as_strided((last,), (1,)).to("cpu", torch.float64)
    rows = min(n_rows, (last - n_cols) // stride + 1)
    return torch.stack([flat[r * stride:r * stride + n_cols] for r in range(rows)])


def _rms_diagnose(got, x64, dy64, w64, x=None, dy=None) -> str:
    rows = lambda d: d.abs().amax(-1, keepdim=True).clamp_min(1e-30)  # noqa: E731
    fits = lambda want, sel=slice(None): bool(((got[sel] - want[sel]).abs() / rows(want[sel]) < 1e-2).all())  # noqa: E731
    n = x64.shape[-1]
    if x is not None and dy is not None and x.stride(0) != dy.stride(0) and x.shape[0] > 2:
        for name, other, stride in (("dy", "x", x.stride(0)), ("x", "dy", dy.stride(0))):
            read = _read_with_stride(dy if name == "dy" else x, stride)
            k = read.shape[0]
            want = _rms_dx64(x64[:k], read, w64, EPS) if name == "dy" else _rms_dx64(read, dy64[:k], w64, EPS)
            if k > 2 and fits(want, slice(0, k)):
                return (f"dx is what {name} read with {other}'s row stride gives ({stride} elements between rows, "
                        f"not {name}_row_stride): each tensor has its own row stride.")
    if x64.shape[0] > 3 and any(fits(_rms_dx64(x64, dy64, w64, e), slice(3, None, 4)) for e in (1e-5, 1e-6, 0.0)):
        return EPS_HINT
    if fits(_rms_dx64(x64, dy64, w64, EPS, layer_norm=True)):
        return "this is LayerNorm's dx: RMSNorm subtracts no mean, from x or from g (no mean(g) term)."
    if fits(_rms_dx64(x64, dy64, w64, EPS, c1=False)):
        return ("dx = g * rstd forgets that rstd depends on every x of the row: subtract x_hat * mean(g * x_hat) "
                "from g first.")
    if n != triton.next_power_of_2(n) and fits(_rms_dx64(x64, dy64, w64, EPS, n=triton.next_power_of_2(n))):
        return "the means were divided by BLOCK_SIZE; divide by n_cols (masked lanes are not part of the row)."
    return ""


def check_rms_backward_kernel(kernel, name: str = "RMSNorm backward dx, rstd recomputed") -> None:
    """Judge ``kernel[(n_rows,)](dx_ptr, dy_ptr, x_ptr, w_ptr, n_cols, x_row_stride, dy_row_stride,
    dx_row_stride, eps, BLOCK_SIZE=next_power_of_2(n_cols))``, rstd recomputed from x: dx against float64."""
    refuse(name, kernel)
    shapes = env.pick(gpu=ROWS_GPU, cpu=((7, 13), (1, 1), (37, 300)))
    signature = "It is launched as " + check_rms_backward_kernel.__doc__.split("``")[1]
    for dtype in env.supported_dtypes():
        for n_rows, n_cols in shapes:
            case = f"{name} ({str(dtype).removeprefix('torch.')}, {n_rows} rows x {n_cols} cols, eps={EPS:g})"
            xg, x = _inputs(n_rows, n_cols, dtype)
            dy = check.randn((n_rows, n_cols + 3), dtype)[:, :n_cols]
            w = check.randn((n_cols,), dtype, scale=0.5, offset=1.0)
            dx = check.Guarded((n_rows, n_cols), dtype)
            _launch(signature, lambda: kernel[(n_rows,)](dx.tensor, dy, x, w, n_cols, x.stride(0), dy.stride(0),  # noqa: B023
                                                         dx.tensor.stride(0), EPS,
                                                         BLOCK_SIZE=triton.next_power_of_2(n_cols)), case, RMS_HINT,
                    (x, dy, w), {"x": x, "dy": dy}, {"x_row_stride": x.stride(0), "dy_row_stride": dy.stride(0),
                                                     "dx_row_stride": dx.tensor.stride(0), "n_cols": n_cols})
            dx.check(f"{case}, dx", "store dx with mask=offsets < n_cols, row pid at dx_ptr + pid * dx_row_stride")
            x64, dy64, w64 = (t.to("cpu", torch.float64) for t in (x, dy, w))
            want = _rms_dx64(x64, dy64, w64, EPS)
            # per row (rows differ in scale by 1e4), the size of the terms dx subtracts: float32 rounds those
            rstd = 1.0 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + EPS)
            g, x_hat = dy64 * w64, x64 * rstd
            terms = g.abs() + (x_hat * (g * x_hat).mean(-1, keepdim=True)).abs()
            scale = (rstd * terms).amax(-1, keepdim=True).clamp_min(1e-30)
            got = dx.tensor.to("cpu", torch.float64)
            check.compare(f"{case}: dx (each row divided by the size of its terms)", got / scale, want / scale,
                          dtype=dtype, atol=2 * check.tolerance(dtype)[0], rtol=0.0,
                          hint=_rms_diagnose(got, x64, dy64, w64, x, dy) or RMS_HINT)
            xg.check(f"{case}, the input buffer")
    check.verdict(name, "dx matches float64: rows around 1000, small rows (eps matters), strided rows, no loads or "
                        "writes outside the tensors")
