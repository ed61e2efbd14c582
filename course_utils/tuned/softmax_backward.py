"""Softmax backward, the shelf ``make bench`` times, and the autograd Function (v3 of
``kernels/softmax_backward.py``).

Rows up to MAX_BLOCK columns: a tile of ROWS rows x BLOCK_N columns per program, y and dy read once.
Longer rows: one program per row loops over tiles twice (sum(y * dy), then dx): y and dy are read
twice, which the benchmark's GB/s (counting one read each) shows honestly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import env
from ..kernels.softmax_backward import _check


@triton.jit
def _softmax_bwd_rows_kernel(dx_ptr, y_ptr, dy_ptr, n_rows, n_cols, y_row_stride, dy_row_stride, dx_row_stride,
                             BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    y = tl.load(y_ptr + rows64 * y_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + rows64 * dy_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dx = y * (dy - tl.sum(y * dy, axis=1)[:, None])
    tl.store(dx_ptr + rows64 * dx_row_stride + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_bwd_looped_kernel(dx_ptr, y_ptr, dy_ptr, n_cols, y_row_stride, dy_row_stride, dx_row_stride,
                               BLOCK_N: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    y_row, dy_row, dx_row = y_ptr + pid * y_row_stride, dy_ptr + pid * dy_row_stride, dx_ptr + pid * dx_row_stride
    offsets = tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in tl.range(0, n_cols, BLOCK_N):  # pass 1: sum(y * dy)
        cols = start + offsets
        mask = cols < n_cols
        acc += tl.load(y_row + cols, mask=mask, other=0.0).to(tl.float32) * \
            tl.load(dy_row + cols, mask=mask, other=0.0).to(tl.float32)
    dot = tl.sum(acc, axis=0)
    for start in tl.range(0, n_cols, BLOCK_N):  # pass 2: dx = y * (dy - dot)
        cols = start + offsets
        mask = cols < n_cols
        y = tl.load(y_row + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_row + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_row + cols, (y * (dy - dot)).to(dx_ptr.dtype.element_ty), mask=mask)


# Chosen on an H100 (results/h100-80gb-hbm3/layernorm_tune.csv, op softmax_bwd, 256 MiB inputs): every
# candidate tile ran at 99-103% of the copy bandwidth for N = 1024..16384; these were the best or tied.
MAX_BLOCK = 16384        # longest row (next power of two) held in registers; longer rows loop
LOOP_BLOCK = 4096        # tile of the looped kernel
TILE_ELEMENTS = 8192     # rows per program = TILE_ELEMENTS // BLOCK_N (at least 1)
ELEMENTS_PER_THREAD = 16  # num_warps = tile / (32 x this), between 4 and MAX_WARPS
MAX_WARPS = 16
WARPS = {16384: 8}       # measured exceptions, by BLOCK_N


def plan(n_rows: int, n_cols: int, *, interpreter: bool | None = None) -> tuple[str, int, int, int]:
    """(version, BLOCK_N, ROWS, num_warps) for ``n_rows`` rows of ``n_cols``."""
    interpreter = (not env.on_gpu()) if interpreter is None else interpreter
    block = triton.next_power_of_2(n_cols)
    if block > MAX_BLOCK:
        return "looped", LOOP_BLOCK, 1, 8
    rows = max(1, min((16384 if interpreter else TILE_ELEMENTS) // block, triton.next_power_of_2(n_rows)))
    warps = max(4, min(MAX_WARPS, rows * block // (32 * ELEMENTS_PER_THREAD)))
    return "rows", block, rows, (warps if interpreter else WARPS.get(block, warps))


def softmax_backward(y: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """dx = y * (dy - sum(y * dy)) along the last dim, from softmax's output ``y`` (one launch)."""
    y2, dy2 = _check(y, dy, "softmax_backward")
    n_rows, n_cols = y2.shape
    dx = torch.empty((n_rows, n_cols), dtype=y.dtype, device=y.device)
    if y.numel() == 0:
        return dx.view(y.shape)
    version, block, rows, warps = plan(n_rows, n_cols)
    strides = (y2.stride(0), dy2.stride(0), dx.stride(0))
    if version == "rows":
        _softmax_bwd_rows_kernel[(triton.cdiv(n_rows, rows),)](dx, y2, dy2, n_rows, n_cols, *strides, BLOCK_N=block,
                                                              ROWS=rows, num_warps=warps)
    else:
        _softmax_bwd_looped_kernel[(n_rows,)](dx, y2, dy2, n_cols, *strides, BLOCK_N=block, num_warps=warps)
    return dx.view(y.shape)


class SoftmaxFunction(torch.autograd.Function):
    """``SoftmaxFunction.apply(x, dim)``: the course's softmax forward, :func:`softmax_backward` backward."""

    @staticmethod
    def forward(ctx, x, dim=-1):
        from .softmax import softmax
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            raise ValueError("SoftmaxFunction: x must be a tensor with at least one dimension")
        dim = dim % x.dim()
        y = softmax(x, dim)
        ctx.save_for_backward(y)
        ctx.dim = dim
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        last = y.dim() - 1
        if ctx.dim != last:
            dx = softmax_backward(y.movedim(ctx.dim, -1), dy.movedim(ctx.dim, -1).contiguous())
            return dx.movedim(-1, ctx.dim), None
        return softmax_backward(y, dy.contiguous()), None


def softmax_autograd(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax that autograd can differentiate, on the course's kernels."""
    return SoftmaxFunction.apply(x, dim)


def compile_cases(info):
    """The launches the compile matrix compiles for ``info`` (see course_utils/aot.py): both shelves."""
    from ..aot import dtype_name, dtypes_for, empty
    from ..kernels.softmax_backward import softmax_backward_teaching
    for dt in dtypes_for(info):
        y = empty(33, 1000, dtype=dt)
        yield f"teaching softmax backward {dtype_name(dt)}", lambda y=y: softmax_backward_teaching(y, y)
        for n in (1000, 1024, 4096, 16384, 100003):
            y = empty(max(1, 2**26 // (n * dt.itemsize)), n, dtype=dt)
            yield f"softmax backward {dtype_name(dt)} N={n}", lambda y=y: softmax_backward(y, y)
    y = empty(2**21, 1024, dtype=torch.float16)
    yield "softmax backward int64 offsets", lambda: softmax_backward(y, y)
