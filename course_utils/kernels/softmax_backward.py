"""Softmax backward along the last dimension (chapter 5's kernels, timed by benchmarks/layernorm.py).

With y = softmax(x) and the upstream gradient dy, the Jacobian-vector product per row is
dx = y * (dy - sum(y * dy)): one reduction and an elementwise tail, like LayerNorm's backward.

v1  ``softmax_backward_ref``: eager ops (multiply, sum, subtract, multiply): four launches.
v2  ``softmax_backward_kernel``: one row per program, the row of y and dy in registers (one launch,
    reads y and dy once, writes dx once).
v3  ``course_utils.tuned.softmax_backward``: several rows per program for short rows, a looped
    two-pass kernel for rows longer than registers hold, and ``SoftmaxFunction`` (autograd).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .layernorm import as_rows


@triton.jit
def softmax_backward_kernel(dx_ptr, y_ptr, dy_ptr, n_cols, y_row_stride, dy_row_stride, dx_row_stride,
                            BLOCK_SIZE: tl.constexpr):
    """v2: program ``pid`` owns row ``pid``: dx = y * (dy - sum(y * dy))."""
    pid = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_cols
    y = tl.load(y_ptr + pid * y_row_stride + offsets, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + pid * dy_row_stride + offsets, mask=mask, other=0.0).to(tl.float32)
    dot = tl.sum(y * dy, axis=0)  # padded lanes hold y = 0: they add nothing
    dx = y * (dy - dot)
    tl.store(dx_ptr + pid * dx_row_stride + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def _check(y, dy, what):
    y2 = as_rows(y, None, what, ("dy", dy))
    if dy.shape != y.shape or dy.dtype != y.dtype:
        raise ValueError(f"{what}: dy must have the shape and dtype of y {tuple(y.shape)} {y.dtype}, "
                         f"got {tuple(dy.shape)} {dy.dtype}")
    return y2, as_rows(dy, None, what)


def softmax_backward_teaching(y: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """v2: dx of softmax along the last dim from its output ``y`` and ``dy`` (one launch)."""
    y2, dy2 = _check(y, dy, "softmax_backward_teaching")
    n_rows, n_cols = y2.shape
    dx = torch.empty((n_rows, n_cols), dtype=y.dtype, device=y.device)
    if y.numel():
        softmax_backward_kernel[(n_rows,)](dx, y2, dy2, n_cols, y2.stride(0), dy2.stride(0), dx.stride(0),
                                           BLOCK_SIZE=triton.next_power_of_2(n_cols))
    return dx.view(y.shape)


def softmax_backward_ref(y: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """v1: y * (dy - sum(y * dy)) in eager ops."""
    return y * (dy - (y * dy).sum(dim=-1, keepdim=True))
