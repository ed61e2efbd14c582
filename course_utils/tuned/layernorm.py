"""LayerNorm and RMSNorm, the shelf ``make bench`` times (chapter 10, v4 of ``kernels/layernorm.py``).

Forward: a tile of ROWS rows x BLOCK_N columns per program (several rows per program when rows are
short), statistics in float32, mean/rstd stored only when a backward pass will need them.
Backward: one kernel reads x and dy once, writes dx, and sums dy * x_hat and dy over its rows into
one float32 partial row per program; ``column_sum_kernel`` adds the partials up (deterministic).
``atomic=True`` adds each program's sums into one float32 row with ``tl.atomic_add`` instead: one
launch fewer, but the order of the additions changes from run to run (the notebook measures both).
Tiles, warps and programs per SM come from :func:`plan`, tuned on an H100 (benchmarks/layernorm.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import env, hardware
from ..kernels.layernorm import as_rows, column_sum


@triton.jit
def _norm_fwd_kernel(y_ptr, x_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, n_rows, n_cols, x_row_stride, y_row_stride,
                     eps, BLOCK_N: tl.constexpr, ROWS: tl.constexpr, RMS: tl.constexpr, HAS_BIAS: tl.constexpr,
                     STATS: tl.constexpr):
    """Rows pid * ROWS + [0, ROWS): y = (x - mean) * rstd * w + b (RMSNorm: x * rstd * w)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + rows64 * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=1) / n_cols
        xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    y = xc * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows64 * y_row_stride + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    if STATS:
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)
        if not RMS:
            tl.store(mean_ptr + rows, mean, mask=row_mask)


@triton.jit
def _norm_bwd_kernel(dx_ptr, dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dw_ptr, db_ptr, n_rows, n_cols,
                     x_row_stride, dy_row_stride, dx_row_stride, rows_per_program, BLOCK_N: tl.constexpr,
                     ROWS: tl.constexpr, RMS: tl.constexpr, ATOMIC: tl.constexpr):
    """dx for the rows [pid * rows_per_program, ...) in tiles of ROWS, and their sums of dy * x_hat
    and dy: stored as partial row pid (ATOMIC=False) or added into dw/db with atomics."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    first = pid * rows_per_program
    end = tl.minimum(first + rows_per_program, n_rows)
    start = first
    while start < end:
        rows = start + tl.arange(0, ROWS)
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
        g = dy * w[None, :]
        c1 = tl.sum(g * x_hat, axis=1) / n_cols
        if RMS:
            dx = (g - x_hat * c1[:, None]) * rstd[:, None]
        else:
            dx = (g - x_hat * c1[:, None] - (tl.sum(g, axis=1) / n_cols)[:, None]) * rstd[:, None]
        tl.store(dx_ptr + rows64 * dx_row_stride + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * x_hat, axis=0)
        db += tl.sum(dy, axis=0)
        start += ROWS
    if ATOMIC:
        tl.atomic_add(dw_ptr + cols, dw, mask=col_mask)
        if not RMS:
            tl.atomic_add(db_ptr + cols, db, mask=col_mask)
    else:
        out = pid.to(tl.int64) * n_cols + cols
        tl.store(dw_ptr + out, dw, mask=col_mask)
        if not RMS:
            tl.store(db_ptr + out, db, mask=col_mask)


# --------------------------------------------------------------------------- plans

MAX_BLOCK_N = 65536
# (BLOCK_N, bytes per element) -> (tile elements, num_warps), forward and backward, measured on an H100
# (results/h100-80gb-hbm3/layernorm_tune.csv); other sizes fall back on the rules in the plan functions.
FWD_TILES: dict[tuple[int, int], tuple[int, int]] = {}
BWD_TILES: dict[tuple[int, int], tuple[int, int]] = {}
FWD_TILE_ELEMENTS = 4096      # default: rows per program = this // BLOCK_N
BWD_TILE_ELEMENTS = 4096
ELEMENTS_PER_THREAD = 16      # default num_warps = tile / (32 x this), between 4 and 32
BWD_PROGRAMS_PER_SM = 4       # backward grid: SMs x this programs, each summing a contiguous run of rows


@dataclass(frozen=True)
class Plan:
    """A launch: BLOCK_N columns, ROWS rows per tile, num_warps, and grid programs."""

    BLOCK_N: int
    ROWS: int
    num_warps: int
    grid: int
    rows_per_program: int = 0   # backward only


def _warps(tile: int) -> int:
    return max(4, min(32, tile // (32 * ELEMENTS_PER_THREAD)))


def _tile(n_rows: int, block: int, tile_elements: int, warps: int | None) -> tuple[int, int]:
    rows = max(1, min(tile_elements // block, triton.next_power_of_2(n_rows)))
    return rows, warps or _warps(rows * block)


def plan_forward(n_rows: int, n_cols: int, itemsize: int, info: hardware.DeviceInfo, *,
                 interpreter: bool | None = None) -> Plan:
    """Tile and warps of the forward kernel: a pure function of the shape and the device."""
    block = triton.next_power_of_2(n_cols)
    if block > MAX_BLOCK_N:
        raise ValueError(f"layer_norm/rms_norm keep a row in registers: at most {MAX_BLOCK_N} columns, got {n_cols}")
    interpreter = (not env.on_gpu()) if interpreter is None else interpreter
    tile, warps = FWD_TILES.get((block, itemsize), (FWD_TILE_ELEMENTS, None)) if info.arch >= 90 else (4096, None)
    rows, warps = _tile(n_rows, block, 16384 if interpreter else tile, warps)
    return Plan(block, rows, warps, triton.cdiv(n_rows, rows))


def plan_backward(n_rows: int, n_cols: int, itemsize: int, info: hardware.DeviceInfo, *,
                  interpreter: bool | None = None, programs_per_sm: int | None = None) -> Plan:
    """Tile, warps and grid of the backward kernel (a contiguous run of rows per program)."""
    block = plan_forward(n_rows, n_cols, itemsize, info, interpreter=interpreter).BLOCK_N
    interpreter = (not env.on_gpu()) if interpreter is None else interpreter
    tile, warps = BWD_TILES.get((block, itemsize), (BWD_TILE_ELEMENTS, None)) if info.arch >= 90 else (2048, None)
    rows, warps = _tile(n_rows, block, tile, warps)
    programs = 4 if interpreter else info.sms * (programs_per_sm or BWD_PROGRAMS_PER_SM)
    rows_per_program = triton.cdiv(triton.cdiv(n_rows, programs), rows) * rows
    return Plan(block, rows, warps, triton.cdiv(n_rows, rows_per_program), rows_per_program)


# --------------------------------------------------------------------------- ops


def _forward(x, weight, bias, eps, rms: bool, stats: bool, what: str):
    x2 = as_rows(x, weight, what, ("bias", bias))
    if bias is not None and bias.shape != weight.shape:
        raise ValueError(f"{what}: bias must have the shape of weight {tuple(weight.shape)}, got {tuple(bias.shape)}")
    n_rows, n_cols = x2.shape
    y = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device) if stats else None
    mean = torch.empty_like(rstd) if stats and not rms else None
    if x.numel():
        p = plan_forward(n_rows, n_cols, x.element_size(), hardware.device_info())
        dummy = y  # pointers the kernel never touches (no bias, no statistics)
        _norm_fwd_kernel[(p.grid,)](y, x2, weight, dummy if bias is None else bias, dummy if mean is None else mean,
                                    dummy if rstd is None else rstd, n_rows, n_cols,
                                    x2.stride(0), y.stride(0), eps, BLOCK_N=p.BLOCK_N, ROWS=p.ROWS, RMS=rms,
                                    HAS_BIAS=bias is not None, STATS=stats, num_warps=p.num_warps)
    return y.view(x.shape), mean, rstd


def _backward(dy, x, weight, mean, rstd, rms: bool, atomic: bool, what: str):
    x2 = as_rows(x, weight, what, ("dy", dy))
    if dy.shape != x.shape:
        raise ValueError(f"{what}: dy must have the shape of x {tuple(x.shape)}, got {tuple(dy.shape)}")
    dy2 = as_rows(dy, None, what)
    n_rows, n_cols = x2.shape
    dx = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        zero = torch.zeros_like(weight)
        return dx.view(x.shape), zero, None if rms else zero.clone()
    p = plan_backward(n_rows, n_cols, x.element_size(), hardware.device_info())
    shape = (n_cols,) if atomic else (p.grid, n_cols)
    dw = (torch.zeros if atomic else torch.empty)(shape, dtype=torch.float32, device=x.device)
    db = dw if rms else (torch.zeros_like(dw) if atomic else torch.empty_like(dw))
    _norm_bwd_kernel[(p.grid,)](dx, dy2, x2, weight, rstd if rms else mean, rstd, dw, db, n_rows, n_cols,
                                x2.stride(0), dy2.stride(0), dx.stride(0), p.rows_per_program, BLOCK_N=p.BLOCK_N,
                                ROWS=p.ROWS, RMS=rms, ATOMIC=atomic, num_warps=p.num_warps)
    if atomic:
        return dx.view(x.shape), dw.to(weight.dtype), None if rms else db.to(weight.dtype)
    return dx.view(x.shape), column_sum(dw, weight.dtype), None if rms else column_sum(db, weight.dtype)


def layer_norm(x, weight, bias=None, eps: float = 1e-5):
    """LayerNorm of ``x`` over its last dim (one launch; ``bias`` may be None). No autograd: see
    :func:`layer_norm_autograd`."""
    return _forward(x, weight, bias, eps, False, False, "layer_norm")[0]


def rms_norm(x, weight, eps: float = 1e-6):
    """RMSNorm of ``x`` over its last dim (one launch). No autograd: see :func:`rms_norm_autograd`."""
    return _forward(x, weight, None, eps, True, False, "rms_norm")[0]


def layer_norm_backward(dy, x, weight, mean, rstd, *, atomic: bool = False):
    """(dx, dw, db) of LayerNorm from the saved float32 statistics; ``atomic`` as in the docstring."""
    return _backward(dy, x, weight, mean, rstd, False, atomic, "layer_norm_backward")


def rms_norm_backward(dy, x, weight, rstd, *, atomic: bool = False):
    """(dx, dw) of RMSNorm from the saved float32 ``rstd``."""
    return _backward(dy, x, weight, None, rstd, True, atomic, "rms_norm_backward")[:2]


class LayerNormFunction(torch.autograd.Function):
    """``LayerNormFunction.apply(x, weight, bias, eps)``: the tuned kernels with autograd."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, mean, rstd = _forward(x, weight, bias, eps, False, True, "LayerNormFunction")
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = _backward(dy.contiguous(), x, weight, mean, rstd, False, False, "LayerNormFunction.backward")
        return dx, dw, db if ctx.has_bias else None, None


class RMSNormFunction(torch.autograd.Function):
    """``RMSNormFunction.apply(x, weight, eps)``: the tuned kernels with autograd."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, _, rstd = _forward(x, weight, None, eps, True, True, "RMSNormFunction")
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw, _ = _backward(dy.contiguous(), x, weight, None, rstd, True, False, "RMSNormFunction.backward")
        return dx, dw, None


def layer_norm_autograd(x, weight, bias=None, eps: float = 1e-5):
    """LayerNorm that autograd can differentiate (x, weight and bias)."""
    return LayerNormFunction.apply(x, weight, bias, eps)


def rms_norm_autograd(x, weight, eps: float = 1e-6):
    """RMSNorm that autograd can differentiate (x and weight)."""
    return RMSNormFunction.apply(x, weight, eps)
