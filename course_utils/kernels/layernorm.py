"""LayerNorm and RMSNorm over the last dimension, forward and backward (chapter 10): the ladder.

v1  ``layer_norm_ref`` / ``rms_norm_ref``: the eager ops (nine for LayerNorm), one launch each.
v2  ``layer_norm_fwd_kernel`` / ``rms_norm_fwd_kernel``: one row per program, the row in registers,
    statistics in float32 in two passes over the registers (mean, then squared deviations).
v3  backward: ``norm_bwd_dx_kernel`` (dx per row from the saved mean and rstd), then dw and db as a
    reduction over rows: ``norm_dw_db_kernel`` writes one partial sum per program, and
    ``column_sum_kernel`` adds the partials up (two launches, deterministic).
v4  ``course_utils.tuned.layernorm``: several rows per program for short rows, dx and the partial
    sums in one kernel, tiles and warps per device, and an atomics variant (what ``make bench`` times).

Launchers: ``layer_norm_teaching``, ``rms_norm_teaching``, ``layer_norm_backward_teaching``,
``rms_norm_backward_teaching``. The production ops ``layer_norm(x, w, b, eps)`` and
``rms_norm(x, w, eps)`` live on the tuned shelf, :mod:`course_utils.tuned.layernorm`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import env

# --------------------------------------------------------------------------- kernels


@triton.jit
def layer_norm_fwd_kernel(y_ptr, x_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, n_cols, x_row_stride, y_row_stride,
                          eps, BLOCK_SIZE: tl.constexpr):
    """v2: program ``pid`` normalizes row ``pid``: y = (x - mean) * rstd * w + b."""
    # torch.compile passes floats as fp64: keep the math in float32 (tl.cast: the interpreter passes a Python float)
    eps = tl.cast(eps, tl.float32)
    pid = tl.program_id(0)
    offsets = tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_cols
    x = tl.load(x_ptr + pid.to(tl.int64) * x_row_stride + offsets, mask=mask, other=0.0).to(tl.float32)
    # Two passes over registers, none over HBM: mean = sum(x) / N, var = sum((x - mean)^2) / N.
    mean = tl.sum(x, axis=0) / n_cols
    xc = tl.where(mask, x - mean, 0.0)  # a padded lane would add mean^2 to the variance
    var = tl.sum(xc * xc, axis=0) / n_cols
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(w_ptr + offsets, mask=mask).to(tl.float32)
    b = tl.load(b_ptr + offsets, mask=mask).to(tl.float32)
    y = xc * rstd * w + b
    tl.store(y_ptr + pid.to(tl.int64) * y_row_stride + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + pid, mean)  # saved for the backward pass: 8 bytes a row
    tl.store(rstd_ptr + pid, rstd)


@triton.jit
def rms_norm_fwd_kernel(y_ptr, x_ptr, w_ptr, rstd_ptr, n_cols, x_row_stride, y_row_stride, eps,
                        BLOCK_SIZE: tl.constexpr):
    """v2, RMSNorm: no mean, no bias: y = x * rstd * w with rstd = 1 / sqrt(mean(x^2) + eps)."""
    eps = tl.cast(eps, tl.float32)  # fp64 from torch.compile: math in float32
    pid = tl.program_id(0)
    offsets = tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_cols
    x = tl.load(x_ptr + pid.to(tl.int64) * x_row_stride + offsets, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + offsets, mask=mask).to(tl.float32)
    tl.store(y_ptr + pid.to(tl.int64) * y_row_stride + offsets, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + pid, rstd)


@triton.jit
def norm_bwd_dx_kernel(dx_ptr, dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, n_cols, x_row_stride, dy_row_stride,
                       dx_row_stride, BLOCK_SIZE: tl.constexpr, RMS: tl.constexpr = False):
    """v3: dx of row ``pid`` from the saved statistics, with x_hat = (x - mean) * rstd and g = dy * w:
    dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat))   (RMSNorm: x_hat = x * rstd, no mean(g) term)."""
    pid = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_cols
    x = tl.load(x_ptr + pid * x_row_stride + offsets, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + pid * dy_row_stride + offsets, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + pid)
    if RMS:
        x_hat = x * rstd
    else:
        x_hat = (x - tl.load(mean_ptr + pid)) * rstd
    g = dy * w  # 0 on padded lanes, so they add nothing below
    c1 = tl.sum(g * x_hat, axis=0) / n_cols
    if RMS:
        dx = (g - x_hat * c1) * rstd
    else:
        dx = (g - tl.sum(g, axis=0) / n_cols - x_hat * c1) * rstd
    tl.store(dx_ptr + pid * dx_row_stride + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def norm_dw_db_kernel(dw_partial_ptr, db_partial_ptr, x_ptr, dy_ptr, mean_ptr, rstd_ptr, n_rows, n_cols,
                      x_row_stride, dy_row_stride, rows_per_program, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      RMS: tl.constexpr = False):
    """v3, stage 1: program (pid_m, pid_n) sums dy * x_hat (dw) and dy (db) over its rows
    [pid_m * rows_per_program, ...) for columns pid_n * BLOCK_N + [0, BLOCK_N), tiles of BLOCK_M rows,
    and stores the sums in row pid_m of the (n_programs, n_cols) float32 partial buffers."""
    pid_m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    first = pid_m * rows_per_program
    end = tl.minimum(first + rows_per_program, n_rows)
    for start in tl.range(first, end, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_mask = rows < end
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        x = tl.load(x_ptr + rows64 * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows64 * dy_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        if RMS:
            x_hat = x * rstd[:, None]
        else:
            x_hat = (x - tl.load(mean_ptr + rows, mask=row_mask, other=0.0)[:, None]) * rstd[:, None]
        dw += tl.sum(dy * x_hat, axis=0)  # axis 0: over the rows, one sum per column
        db += tl.sum(dy, axis=0)
    out = pid_m.to(tl.int64) * n_cols + cols
    tl.store(dw_partial_ptr + out, dw, mask=col_mask)
    if not RMS:
        tl.store(db_partial_ptr + out, db, mask=col_mask)


@triton.jit
def column_sum_kernel(out_ptr, partial_ptr, n_partials, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """v3, stage 2: out[j] = sum_i partial[i, j] over the n_partials rows, in a fixed order."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in tl.range(0, n_partials, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        mask = (rows < n_partials)[:, None] & col_mask[None, :]
        tile = tl.load(partial_ptr + rows.to(tl.int64)[:, None] * n_cols + cols[None, :], mask=mask, other=0.0)
        acc += tl.sum(tile, axis=0)
    tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=col_mask)


# --------------------------------------------------------------------------- launchers

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ROWS_PER_PROGRAM = 64   # teaching backward: rows summed by one program of the dw/db stage 1
REDUCE_BLOCK_N = 64     # columns per program in both reduction stages


def as_rows(x: torch.Tensor, w: torch.Tensor | None, what: str, *others) -> torch.Tensor:
    """``x`` as a 2-D (rows, N) tensor whose rows may be strided; checks ``w`` (and ``others``) too."""
    for name, t in (("x", x), ("weight", w), *others):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in DTYPES:
            raise TypeError(f"{what}: {name} must be float32, float16 or bfloat16, got {t.dtype}")
        if t.device.type != env.DEVICE.type:
            raise ValueError(f"{what}: {name} must be on {env.DEVICE} (mode {env.MODE}), got {t.device}")
    if x.dim() == 0:
        raise ValueError(f"{what}: x must have at least one dimension, got a scalar")
    n = x.shape[-1]
    if w is not None and (w.dim() != 1 or w.shape[0] != n or not w.is_contiguous()):
        raise ValueError(f"{what}: weight must be a contiguous 1-D tensor of {n} (x.shape[-1]) elements, "
                         f"got shape {tuple(w.shape)}")
    if x.stride(-1) != 1 and n > 1:
        x = x.contiguous()
    if x.dim() == 1:
        return x.unsqueeze(0)
    try:
        return x.view(-1, n)  # keeps a row stride wider than N (rows read in place)
    except RuntimeError:
        return x.reshape(-1, n)


def _fwd_args(x2):
    n_rows, n_cols = x2.shape
    return n_rows, n_cols, triton.next_power_of_2(n_cols)


def layer_norm_teaching(x, weight, bias, eps: float = 1e-5, *, return_stats: bool = False):
    """v2: LayerNorm of ``x`` over its last dim with one program per row (one launch)."""
    x2 = as_rows(x, weight, "layer_norm_teaching", ("bias", bias))
    if bias is None or bias.shape != weight.shape:
        raise ValueError(f"layer_norm_teaching: bias must have the shape of weight {tuple(weight.shape)}")
    n_rows, n_cols, block = _fwd_args(x2)
    y = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    mean = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    if x.numel():
        layer_norm_fwd_kernel[(n_rows,)](y, x2, weight, bias, mean, rstd, n_cols, x2.stride(0), y.stride(0), eps,
                                         BLOCK_SIZE=block)
    y = y.view(x.shape)
    return (y, mean, rstd) if return_stats else y


def rms_norm_teaching(x, weight, eps: float = 1e-6, *, return_stats: bool = False):
    """v2: RMSNorm of ``x`` over its last dim with one program per row (one launch)."""
    x2 = as_rows(x, weight, "rms_norm_teaching")
    n_rows, n_cols, block = _fwd_args(x2)
    y = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if x.numel():
        rms_norm_fwd_kernel[(n_rows,)](y, x2, weight, rstd, n_cols, x2.stride(0), y.stride(0), eps, BLOCK_SIZE=block)
    y = y.view(x.shape)
    return (y, rstd) if return_stats else y


def column_sum(partial: torch.Tensor, dtype: torch.dtype, block_n: int = REDUCE_BLOCK_N) -> torch.Tensor:
    """Stage 2: the sum over the rows of a contiguous float32 (n_partials, N) buffer, in ``dtype``; ``block_n``
    columns a program (on a GPU the tile's width sets the order of the additions, so the last bits too)."""
    n_partials, n_cols = partial.shape
    out = torch.empty(n_cols, dtype=dtype, device=partial.device)
    grid = (-(-n_cols // block_n),)   # ceil division in plain Python: cheaper than triton.cdiv per call
    column_sum_kernel[grid](out, partial, n_partials, n_cols, BLOCK_M=32, BLOCK_N=block_n)
    return out


def _backward_teaching(dy, x, weight, mean, rstd, rms: bool, what: str):
    x2 = as_rows(x, weight, what, ("dy", dy))
    if dy.shape != x.shape:
        raise ValueError(f"{what}: dy must have the shape of x {tuple(x.shape)}, got {tuple(dy.shape)}")
    dy2 = as_rows(dy, None, what)
    n_rows, n_cols, block = _fwd_args(x2)
    dx = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    n_programs = max(1, triton.cdiv(n_rows, ROWS_PER_PROGRAM))
    dw_partial = torch.empty((n_programs, n_cols), dtype=torch.float32, device=x.device)
    db_partial = dw_partial if rms else torch.empty_like(dw_partial)
    mean = rstd if rms else mean
    if x.numel():
        norm_bwd_dx_kernel[(n_rows,)](dx, dy2, x2, weight, mean, rstd, n_cols, x2.stride(0), dy2.stride(0),
                                      dx.stride(0), BLOCK_SIZE=block, RMS=rms)
        grid = (n_programs, triton.cdiv(n_cols, REDUCE_BLOCK_N))
        norm_dw_db_kernel[grid](dw_partial, db_partial, x2, dy2, mean, rstd, n_rows, n_cols, x2.stride(0),
                                dy2.stride(0), ROWS_PER_PROGRAM, BLOCK_M=16, BLOCK_N=REDUCE_BLOCK_N, RMS=rms)
    dw = column_sum(dw_partial, weight.dtype) if n_cols else torch.zeros_like(weight)
    db = None if rms else (column_sum(db_partial, weight.dtype) if n_cols else torch.zeros_like(weight))
    return dx.view(x.shape), dw, db


def layer_norm_backward_teaching(dy, x, weight, mean, rstd):
    """v3: (dx, dw, db) of LayerNorm from the saved float32 ``mean`` and ``rstd`` (four launches)."""
    return _backward_teaching(dy, x, weight, mean, rstd, False, "layer_norm_backward_teaching")


def rms_norm_backward_teaching(dy, x, weight, rstd):
    """v3: (dx, dw) of RMSNorm from the saved float32 ``rstd`` (three launches)."""
    dx, dw, _ = _backward_teaching(dy, x, weight, None, rstd, True, "rms_norm_backward_teaching")
    return dx, dw


def layer_norm_ref(x, weight, bias, eps: float = 1e-5):
    """v1: the nine eager ops that ``traffic.layernorm`` counts (mean, sub, pow, mean, add, sqrt, div,
    mul, add)."""
    mean = x.mean(dim=-1, keepdim=True)
    xc = x - mean
    var = xc.pow(2).mean(dim=-1, keepdim=True)
    std = (var + eps).sqrt()
    return xc / std * weight + bias


def rms_norm_ref(x, weight, eps: float = 1e-6):
    """v1: RMSNorm in eager ops: x / sqrt(mean(x^2) + eps) * w."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight
