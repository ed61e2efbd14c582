"""Residual add + LayerNorm in one kernel, forward and backward (chapter 12): the production fusion.

A pre-norm transformer block adds each sublayer's output into the residual stream and normalizes the
sum for the next sublayer: ``s = x + residual``, ``y = LayerNorm(s)``. Eagerly that is two kernels
and the sum makes a round trip through HBM. Apex (``FusedLayerNorm`` with residual), Liger and vLLM
(``fused_add_rms_norm``) all fuse it; so does this file.

v1  ``add_layer_norm_ref``: the eager ops, ``s = x + r`` then ``F.layer_norm(s)``.
v2  ``add_layer_norm_fwd_kernel``: a tile of ROWS rows per program reads x and r once, writes s (the
    new residual stream) and y, and the float32 mean and rstd the backward needs (8 bytes a row).
v3  ``add_layer_norm_bwd_kernel``: the gradient of the residual stream arrives twice, as ``dy`` (through
    the norm) and ``ds`` (straight down the stream); one kernel reads s, dy and ds once and writes
    ``dx = dresidual = ds + dLN(dy)`` (both inputs of the add get the same gradient), and each program's
    partial sums of dy * s_hat and dy; ``column_sum_kernel`` (chapter 10) adds the partials up. When the
    stream is wider than the branch (float32 against bf16) it can write dx in both dtypes (``LOW``).

Launchers: ``add_layer_norm_teaching`` (returns y, s, mean, rstd) and ``add_layer_norm_backward_teaching``
(returns dx, dw, db). The registered operator ``torch.ops.course.add_layer_norm`` is in
:mod:`course_utils.ops`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .layernorm import DTYPES, column_sum

MAX_BLOCK_N = 16384     # a row (and two float32 accumulator rows in backward) stays in registers
TILE_ELEMENTS = 4096    # rows per program = TILE_ELEMENTS // BLOCK_N (at least one)


@triton.jit
def add_layer_norm_fwd_kernel(s_ptr, y_ptr, x_ptr, r_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, n_rows, n_cols,
                              x_row_stride, r_row_stride, eps, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    """Rows pid * ROWS + [0, ROWS): s = x + r, y = (s - mean) * rstd * w + b; s and y contiguous."""
    # torch.compile passes floats as fp64: keep the math in float32 (tl.cast: the interpreter passes a Python float)
    eps = tl.cast(eps, tl.float32)
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + rows64 * x_row_stride + cols[None, :], mask=mask, other=0.0)
    r = tl.load(r_ptr + rows64 * r_row_stride + cols[None, :], mask=mask, other=0.0)
    s = x.to(tl.float32) + r.to(tl.float32)
    s_out = s.to(s_ptr.dtype.element_ty)
    tl.store(s_ptr + rows64 * n_cols + cols[None, :], s_out, mask=mask)
    s = s_out.to(tl.float32)  # normalize the stream as stored, so the backward sees the same s
    mean = tl.sum(s, axis=1) / n_cols
    sc = tl.where(mask, s - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(sc * sc, axis=1) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    y = sc * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(y_ptr + rows64 * n_cols + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + rows, mean, mask=row_mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@triton.jit
def add_layer_norm_bwd_kernel(dx_ptr, dx_low_ptr, dy_ptr, ds_ptr, s_ptr, w_ptr, mean_ptr, rstd_ptr, dw_ptr, db_ptr,
                              n_rows, n_cols, dy_row_stride, ds_row_stride, rows_per_program,
                              BLOCK_N: tl.constexpr, ROWS: tl.constexpr, HAS_DS: tl.constexpr,
                              STAGES: tl.constexpr = None, LOW: tl.constexpr = False):
    """dx = ds + rstd * (g - mean(g) - s_hat * mean(g * s_hat)), g = dy * w, for the rows
    [pid * rows_per_program, ...) in tiles of ROWS; this run's sums of dy * s_hat and dy go to
    partial row pid of dw and db (float32). STAGES (None: the loop as written) asks Triton to fetch the
    next tile while this one computes (it pipelines loads that feed no dot product only when asked).
    LOW: dx is stored a second time, in dx_low_ptr's dtype (the narrower input of the add, the branch's
    compute dtype), from the same registers: the cast that would read dx back from HBM is not needed."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    first = pid * rows_per_program
    end = tl.minimum(first + rows_per_program, n_rows)
    for start in tl.range(first, end, ROWS, num_stages=STAGES):
        rows = start + tl.arange(0, ROWS)
        row_mask = rows < end
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        s = tl.load(s_ptr + rows64 * n_cols + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows64 * dy_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        s_hat = tl.where(mask, (s - mean[:, None]) * rstd[:, None], 0.0)
        g = dy * w[None, :]
        c1 = tl.sum(g * s_hat, axis=1) / n_cols
        c2 = tl.sum(g, axis=1) / n_cols
        dx = (g - s_hat * c1[:, None] - c2[:, None]) * rstd[:, None]
        if HAS_DS:
            dx += tl.load(ds_ptr + rows64 * ds_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + rows64 * n_cols + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if LOW:
            tl.store(dx_low_ptr + rows64 * n_cols + cols[None, :], dx.to(dx_low_ptr.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * s_hat, axis=0)
        db += tl.sum(dy, axis=0)
    out = pid.to(tl.int64) * n_cols + cols
    tl.store(dw_ptr + out, dw, mask=col_mask)
    tl.store(db_ptr + out, db, mask=col_mask)


# --------------------------------------------------------------------------- launchers


def check(what: str, x, weight, *others, max_cols: int = MAX_BLOCK_N) -> int:
    """Checks x (..., N), weight (N,) contiguous and ``others`` (name, tensor or None, shape); returns N."""
    for name, t in (("x", x), ("weight", weight)) + tuple(o[:2] for o in others):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in DTYPES:
            raise TypeError(f"{what}: {name} must be float32, float16 or bfloat16, got {t.dtype}")
        if t.device != x.device:
            raise ValueError(f"{what}: {name} is on {t.device} but x is on {x.device}")
    if x.dim() == 0:
        raise ValueError(f"{what}: x must have at least one dimension, got a scalar")
    n = x.shape[-1]
    if weight.dim() != 1 or weight.shape[0] != n or not weight.is_contiguous():
        raise ValueError(f"{what}: weight must be a contiguous 1-D tensor of {n} (x.shape[-1]) elements, "
                         f"got shape {tuple(weight.shape)}")
    if triton.next_power_of_2(n) > max_cols:
        raise ValueError(f"{what}: rows are kept in registers: at most {max_cols} columns, got {n}")
    for name, t, shape in others:
        if t is not None and tuple(t.shape) != tuple(shape):
            raise ValueError(f"{what}: {name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    return n


def rows_of(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` as (rows, n) with unit column stride (a view when the rows are evenly strided)."""
    if t.stride(-1) != 1 and n > 1:
        t = t.contiguous()
    try:
        return t.view(-1, n)
    except RuntimeError:
        return t.reshape(-1, n)


def add_layer_norm_teaching(x, residual, weight, bias, eps: float = 1e-5, *, rows: int | None = None,
                            num_warps: int | None = None):
    """v2: (y, s, mean, rstd) with s = x + residual and y = LayerNorm(s), one launch."""
    n = check("add_layer_norm", x, weight, ("residual", residual, x.shape), ("bias", bias, weight.shape))
    if bias is None:
        raise ValueError("add_layer_norm: bias is required (pass zeros for none)")
    x2, r2 = rows_of(x, n), rows_of(residual, n)
    n_rows = x2.shape[0]
    s = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    y = torch.empty_like(s)  # s and y in the wider dtype of the two, as ``x + residual`` would be
    mean = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    if x.numel():
        block = triton.next_power_of_2(n)
        rows = rows or max(1, min(TILE_ELEMENTS // block, triton.next_power_of_2(n_rows)))
        add_layer_norm_fwd_kernel[(triton.cdiv(n_rows, rows),)](
            s, y, x2, r2, weight, bias, mean, rstd, n_rows, n, x2.stride(0), r2.stride(0), eps,
            BLOCK_N=block, ROWS=rows, num_warps=num_warps or max(4, min(16, rows * block // 512)))
    return y, s, mean, rstd


def add_layer_norm_backward_teaching(dy, ds, s, weight, mean, rstd, *, programs: int = 64,
                                     rows: int | None = None, num_warps: int | None = None,
                                     stages: int | None = None, low_dtype: torch.dtype | None = None):
    """v3: (dx, dw, db) of (y, s) = add_layer_norm(x, r) from dy, ds (None: no gradient on s) and the
    saved s, mean and rstd; dx is also the residual's gradient. Two launches (rows, then columns).
    ``stages``: pipeline stages of the row loop (None: as written; needs sm_80+ to matter).
    ``low_dtype``: also dx in that dtype, written by the same kernel: (dx, dx_low, dw, db)."""
    n = check("add_layer_norm_backward", s, weight, ("dy", dy, s.shape), ("ds", ds, s.shape))
    s2, dy2 = rows_of(s, n), rows_of(dy, n)
    ds2 = rows_of(ds, n) if ds is not None else dy2
    n_rows = s2.shape[0]
    dx = torch.empty(s.shape, dtype=s.dtype, device=s.device)
    dx_low = None if low_dtype is None else torch.empty(s.shape, dtype=low_dtype, device=s.device)
    if s.numel() == 0:
        return (dx, *(() if dx_low is None else (dx_low,)), torch.zeros_like(weight), torch.zeros_like(weight))
    block = triton.next_power_of_2(n)
    rows = rows or max(1, min(TILE_ELEMENTS // block, triton.next_power_of_2(n_rows)))
    per_program = triton.cdiv(triton.cdiv(n_rows, programs), rows) * rows
    grid = triton.cdiv(n_rows, per_program)
    dw = torch.empty((grid, n), dtype=torch.float32, device=s.device)
    db = torch.empty_like(dw)
    add_layer_norm_bwd_kernel[(grid,)](dx, dx if dx_low is None else dx_low, dy2, ds2, s2, weight, mean, rstd, dw,
                                       db, n_rows, n, dy2.stride(0), ds2.stride(0), per_program, BLOCK_N=block,
                                       ROWS=rows, HAS_DS=ds is not None, STAGES=stages, LOW=dx_low is not None,
                                       num_warps=num_warps or max(4, min(16, rows * block // 512)))
    sums = column_sum(dw, weight.dtype), column_sum(db, weight.dtype)
    return (dx, *sums) if dx_low is None else (dx, dx_low, *sums)


def add_layer_norm_ref(x, residual, weight, bias, eps: float = 1e-5):
    """v1: (y, s) in eager ops (two kernels, s through HBM twice)."""
    s = x + residual
    return F.layer_norm(s, (s.shape[-1],), weight, bias, eps), s


def compile_cases(info):
    """The launches the compile matrix compiles for ``info`` (course_utils/aot.py)."""
    from ..aot import dtype_name, dtypes_for, empty
    for dt in dtypes_for(info):
        name = dtype_name(dt)
        for m, n, rows in ((7, 1000, None), (8192, 768, 4), (64, 8192, 1)):   # odd, GPT-2 small, long rows
            x, w, st = empty(m, n, dtype=dt), empty(n, dtype=dt), empty(m)
            r = empty(m, n)                                                # a float32 residual stream
            yield (f"add_layer_norm {name} {m}x{n}", lambda x=x, r=r, w=w, rows=rows:
                   add_layer_norm_teaching(x, r, w, w, rows=rows))
            for s in (x, r):
                for ds in (s, None):
                    yield (f"add_layer_norm backward {name} s={dtype_name(s.dtype)} {m}x{n} ds={ds is not None}",
                           lambda s=s, w=w, st=st, ds=ds, rows=rows: add_layer_norm_backward_teaching(
                               s, ds, s, w, st, st, rows=rows))
            yield (f"add_layer_norm backward {name} s=float32 {m}x{n} dx also in {name}",
                   lambda r=r, w=w, st=st, rows=rows, dt=dt: add_layer_norm_backward_teaching(
                       r, r, r, w, st, st, rows=rows, low_dtype=dt))
        if info.arch >= 80:   # the op's launch at GPT-2's shape: the row loop pipelined, 4 warps
            s, w, st = empty(8192, 768, dtype=dt), empty(768, dtype=dt), empty(8192)
            yield (f"add_layer_norm backward pipelined {name} 8192x768", lambda s=s, w=w, st=st:
                   add_layer_norm_backward_teaching(s, s, s, w, st, st, programs=2 * info.sms, rows=4,
                                                    num_warps=4, stages=3))
    big = empty(2**21 + 1, 1024, dtype=torch.float16)   # past 2^31 elements: int64 row offsets
    w, st = empty(1024, dtype=torch.float16), empty(2**21 + 1)
    yield "add_layer_norm 2^31+", lambda: add_layer_norm_teaching(big, big, w, w)
    yield "add_layer_norm backward 2^31+", lambda: add_layer_norm_backward_teaching(big, big, big, w, st, st)
