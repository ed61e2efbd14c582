"""Checks for chapter 10: the LayerNorm forward row kernel and its launcher, the dw/db stage-1 reduction
(every partial row compared) and RMSNorm's dx with rstd recomputed; each docstring gives the launch.
(The shared inputs, statistics and diagnosis are in :mod:`.layernorm_common`; the backward checks in
:mod:`.layernorm_backward` and :mod:`.rms_backward`, re-exported here.)
Fresh inputs every call: odd row lengths; strided rows (the gap holds +/-3e4); every other row around
OFFSET = 1000 (E[x^2] - E[x]^2 cancels in float32, 16-bit sums overflow); one row in four with a variance
below the non-default ``eps`` every check passes; NaN-poisoned outputs in guard zones; loads outside the
inputs recorded under the interpreter; the course's kernels, launchers and torch's norms refused as answers;
float16 rows whose last starts past 2**31 elements (``offsets64.wide_rows``), where an int32 row offset
wraps (the forward, RMSNorm's dx and the dw/db partial sums).
Under the interpreter the loads also show a tensor's rows read with another tensor's stride (named), and, for
the forward in chunks (exercise 10.1, Welford's statistics), how many times the kernel reads each element of
x: one pass for the statistics and one for y, where a mean pass, a variance pass and a y pass read it three
times (the numbers alone cannot tell the methods apart: both are float32-accurate).
"""

from __future__ import annotations

import torch
import triton

from .. import check, env
from .layernorm_backward import check_dw_db_kernel  # noqa: F401  (re-exported)
from .layernorm_common import (
    EPS,
    F32_EPS,
    ROWS_GPU,
    _inputs,
    _launch,
    _rel,
    _stats64,
    diagnose_stats,
    refuse,
    rstd_rtol,
    store_stride_fault,
)
from .loads import LOADS_SEEN
from .offsets64 import HINT as WIDE_HINT
from .offsets64 import wide_case, wide_last_row, wide_launch, wide_rows
from .rms_backward import _rms_diagnose, check_rms_backward_kernel  # noqa: F401  (re-exported)

FWD_HINT = ("compute in float32 (x.to(tl.float32)): mean = sum(x) / n_cols, then the variance of the centered "
            "values (x - mean, with masked lanes set to 0), rstd = 1 / sqrt(var + eps); store mean and rstd.")
CHUNK_HINT = ("Welford's statistics, in float32, in one pass over the row: each chunk's count n_b (its lanes inside "
              "the row), mean m_b and M2_b = sum((x - m_b)^2) over those lanes, merged with Chan's formula (delta = "
              "m_b - m_a, taken before the mean moves); var = M2 / n_cols, rstd = 1 / sqrt(var + eps); then a second "
              "pass over the chunks writes y.")
#: exercise 10.1: reads of each element of x, the statistics' pass and y's
CHUNK_PASSES = 2


def _y_atol(dtype, n_cols, mean64, rstd64, w) -> float:
    """y's tolerance: the dtype's, plus log2(N) float32 roundings of |mean| (offset rows) times rstd * |w|."""
    cond = float((mean64.abs() * rstd64).max()) * float(w.abs().max())
    return check.tolerance(dtype)[0] + max(1.0, n_cols.bit_length()) * F32_EPS * cond


def _y_hint(y, x64, mean64, rstd64, w, b, block) -> str:
    """y's hint: names w and b read at the first chunk's columns in every chunk (rows longer than a block)."""
    n = x64.shape[-1]
    if block < n:
        cols = torch.arange(n) % block
        w64, b64 = w.cpu().double()[cols], b.cpu().double()[cols]
        want = (x64 - mean64[:, None]) * rstd64[:, None] * w64 + b64
        got = y.to("cpu", torch.float64)
        if bool(((got - want).abs() / want.abs().amax(-1, keepdim=True).clamp_min(1e-30) < 1e-2).all()):
            return ("y matches w and b read at the first chunk's columns in every chunk: load them at the chunk's "
                    "own columns, w_ptr + start + offsets (and b_ptr + start + offsets), as x.")
    return "y = (x - mean) * rstd * w + b, stored in y's dtype (y.to(y_ptr.dtype.element_ty))."


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
            x64, mean64, rstd64 = _stats64(before)
            y64 = (x64 - mean64[:, None]) * rstd64[:, None] * w.cpu().double() + b.cpu().double()
            for g, what in ((y, "y"), (mean, "mean"), (rstd, "rstd")):
                try:
                    g.check(f"{case}, {what}", "mask the store of y; one mean and one rstd per row, at pid")
                except check.CheckFailure:
                    fault = store_stride_fault(y, y64, "y", {"x_row_stride": x.stride(0)}) if g is y else ""
                    if fault:
                        raise check.CheckFailure(f"{case}: {fault}") from None
                    raise
            hint = diagnose_stats(mean.tensor, rstd.tensor, before, block=block) or fwd_hint
            if chunk and hint.startswith("rstd matches 1 / sqrt(mean(x^2) + eps)"):
                hint += (" In Welford's method that is also what Chan's merge gives when its delta^2 * n_a * n_b / n "
                         "takes n_a after the count moved (n_a = n): for the first chunk, n_a = 0 and delta = m_b, "
                         "so the term must vanish. Update the count last.")
            check.compare(f"{case}: mean", mean.tensor, mean64, dtype=torch.float32, atol=1e-4, rtol=1e-5, hint=hint)
            rtol = rstd_rtol(mean64, rstd64, n_cols)
            off = _rel(rstd.tensor, rstd64) > rtol
            if bool(off.any()):  # the first row off, named by check.compare at that row's own tolerance
                row = int(off.nonzero()[0])
                check.compare(f"{case}: rstd (row {row})", rstd.tensor[row:row + 1], rstd64[row:row + 1],
                              dtype=torch.float32, atol=0.0, rtol=float(rtol[row]), hint=hint)
            check.compare(f"{case}: y", y.tensor, y64, dtype=dtype, atol=_y_atol(dtype, n_cols, mean64, rstd64, w),
                          hint=_y_hint(y.tensor, x64, mean64, rstd64, w, b, block))
            xg.check(f"{case}, the input buffer")
            if not torch.equal(x, before):
                raise check.CheckFailure(f"{case}: your kernel changed its input; it must only write y, mean, rstd")
            _check_passes(case, loads, x, chunk)
    _check_forward_past_2_31(kernel, name, chunk, signature)
    check.verdict(name, "y, mean and rstd match float64: rows around 1000, small rows (eps matters), strided rows, "
                        "no loads or writes outside the tensors " + LOADS_SEEN)


def _check_forward_past_2_31(kernel, name: str, chunk, signature: str) -> None:
    """float16 rows whose last starts past 2**31 elements (``offsets64.wide_rows``): pid * x_row_stride in
    int32 wraps there, and the kernel reads and writes the padding instead."""
    n_cols = 3 * (chunk or 64) + 5
    case = wide_case(name, n_cols)
    x_small = check.randn((3, n_cols), torch.float16, scale=2.0)
    w = check.randn((n_cols,), torch.float16, scale=0.5, offset=1.0)
    b = check.randn((n_cols,), torch.float16)
    mean, rstd = (torch.empty(3, dtype=torch.float32, device=w.device) for _ in range(2))
    block = chunk or triton.next_power_of_2(n_cols)

    def run(x, y):
        x.copy_(x_small)
        y.fill_(float("nan"))
        wide_launch(lambda: kernel[(3,)](y, x, w, b, mean, rstd, n_cols, x.stride(0), y.stride(0), EPS,
                                         BLOCK_SIZE=block), case, signature)
        return y.to("cpu", torch.float64)

    with wide_rows(n_cols, ("x", "y")) as t:
        if t is None:
            return
        got = run(t.pop("x"), t.pop("y"))   # the views die with run: the memory goes back as the block ends
    wide_last_row(case, got, "y", "x_row_stride (and y_row_stride)")
    x64, mean64, rstd64 = _stats64(x_small)
    y64 = (x64 - mean64[:, None]) * rstd64[:, None] * w.cpu().double() + b.cpu().double()
    check.compare(f"{case}: y", got, y64, dtype=torch.float16, hint=WIDE_HINT.format(what="x_row_stride"))


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
