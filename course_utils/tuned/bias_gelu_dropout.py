"""Bias + GELU + dropout with the Philox seed in DEVICE memory (chapter 12), forward and backward.

Chapter 4's ``bias_gelu_dropout_kernel`` and chapter 11's ``bias_gelu_backward_kernel`` take the seed
as a launch argument: a CUDA graph freezes it at capture, so every replay would draw the same mask.
These two kernels are the same computations with one change: the seed is ``tl.load(seed_ptr)``,
read by the kernel from a one-element int64 tensor. The caller bumps that tensor in place
(``seed.add_(1)``, itself a kernel, so it is captured too) once per step, after the backward pass:
each replay then draws a new mask, and the backward regenerates the forward's mask because it reads
the same value. Element i of the flat (rows x columns) tensor is kept when Philox(seed, i) >= p, as
in chapter 4, so ``course_utils.kernels.elementwise.bias_gelu_dropout_ref(x, b, p, int(seed))`` is
the reference. Outputs keep the input's layout, as PyTorch's elementwise ops do: a dense x of any
strides (transposed, permuted, channels-last) is read in place and y, dx get its strides
(:func:`output_like`); a slice with gaps is copied once and the outputs are contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernels.elementwise import gelu_math
from ..kernels.gelu_backward import gelu_grad
from ..kernels.layouts import (
    NO_LAYOUT,
    bias_gelu_strided,
    in_place,
    lead_layout,
    output_like,  # noqa: F401  (the layout the op returns: ops/dropout.py's fakes)
    row_offsets,
)
from .launch import launch

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def bias_gelu_dropout_seeded_kernel(x_ptr, bias_ptr, y_ptr, seed_ptr, n_elements, n_cols, p, keep_scale,
                                    BLOCK_SIZE: tl.constexpr, DROPOUT: tl.constexpr):
    p, keep_scale = tl.cast(p, tl.float32), tl.cast(keep_scale, tl.float32)  # fp64 from torch.compile: math in float32
    pid = tl.program_id(0)
    offsets = pid.to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(bias_ptr + offsets % n_cols, mask=mask, other=0.0).to(tl.float32)
    y = gelu_math(x + b, True)
    if DROPOUT:
        seed = tl.load(seed_ptr)                     # read on the device: a graph replay sees the new value
        y = tl.where(tl.rand(seed, offsets) >= p, y * keep_scale, 0.0)
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def bias_gelu_dropout_seeded_bwd_kernel(dy_ptr, x_ptr, bias_ptr, dx_ptr, db_partial_ptr, seed_ptr, n_rows, n_cols,
                                        p, keep_scale, n1, n2, s0, s1, s2, r0, r1, r2, col_stride,
                                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DROPOUT: tl.constexpr,
                                        STRIDED: tl.constexpr):
    p, keep_scale = tl.cast(p, tl.float32), tl.cast(keep_scale, tl.float32)  # fp64 from torch.compile: math in float32
    pid_m = tl.program_id(axis=0)
    pid_n = tl.program_id(axis=1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    mask = (rows[:, None] < n_rows) & col_mask[None, :]
    offsets = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]   # the logical flat index: the mask's
    addr = offsets
    if STRIDED:   # x, dy and dx share one dense layout: addresses from x's strides
        offset, row = row_offsets(rows.to(tl.int64), n1, n2, s0, s1, s2, r0, r1, r2)
        addr = offset[:, None] + cols.to(tl.int64)[None, :] * col_stride
        offsets = row[:, None] * n_cols + cols[None, :]       # the tile's rows in memory order: their logical index
    x = tl.load(x_ptr + addr, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + addr, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dz = dy * gelu_grad(x + b[None, :], True)
    if DROPOUT:
        seed = tl.load(seed_ptr)
        dz = tl.where(tl.rand(seed, offsets) >= p, dz * keep_scale, 0.0)
    tl.store(dx_ptr + addr, dz.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(db_partial_ptr + pid_m * n_cols + cols, tl.sum(tl.where(mask, dz, 0.0), axis=0), mask=col_mask)


def check(x, bias, p, seed, what: str = "bias_gelu_dropout") -> None:
    for name, t in (("x", x), ("bias", bias), ("seed", seed)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != x.device:
            raise ValueError(f"{what}: {name} is on {t.device} but x is on {x.device}")
    if x.dtype not in DTYPES or bias.dtype not in DTYPES:
        raise TypeError(f"{what}: x and bias must be float32, float16 or bfloat16, got {x.dtype}, {bias.dtype}")
    if x.dim() < 1 or bias.dim() != 1 or bias.shape[0] != x.shape[-1]:
        raise ValueError(f"{what}: bias must be 1-D with x.shape[-1] = {x.shape[-1] if x.dim() else None} values, "
                         f"got shape {tuple(bias.shape)}")
    if seed.dtype != torch.int64 or seed.numel() != 1:
        raise TypeError(f"{what}: seed must be a one-element int64 tensor (torch.tensor([s], device=x.device)), "
                        f"got {seed.dtype} with {seed.numel()} elements")
    if not 0.0 <= float(p) < 1.0:
        raise ValueError(f"{what}: dropout probability p must be in [0, 1), got {p}")


def bias_gelu_dropout(x, bias, p: float, seed: torch.Tensor, *, block: int = 1024, num_warps: int = 4):
    """``dropout(gelu_tanh(x + bias), p)``, the seed read from the device tensor ``seed``; y in x's
    layout (:func:`output_like`)."""
    check(x, bias, p, seed)
    x, bias = (x if in_place(x) else x.contiguous()), bias.contiguous()
    y = torch.empty_like(x)
    n = x.numel()
    if n and not x.is_contiguous():   # dense, any strides: the strided kernel, the mask by logical index
        bias_gelu_strided(x, bias, y, 1.0, float(p), seed_tensor=seed)
    elif n:
        launch(bias_gelu_dropout_seeded_kernel, "bias_gelu_dropout", (-(-n // block),),
               (x, bias, y, seed, n, x.shape[-1], float(p), 1.0 / (1.0 - float(p))),
               dict(BLOCK_SIZE=block, DROPOUT=p > 0, num_warps=num_warps))
    return y


def _layout(x: torch.Tensor) -> tuple:
    """The STRIDED kernel's layout arguments (unused for a contiguous x: no Python work per call then)."""
    return NO_LAYOUT if x.is_contiguous() else lead_layout(x)


def bias_gelu_dropout_backward(dy, x, bias, p: float, seed: torch.Tensor, *, block_m: int = 32, block_n: int = 64):
    """(dx, db) of :func:`bias_gelu_dropout`, the mask regenerated from the same device seed; dx in x's
    layout (:func:`output_like`), dy read in place when it has that layout, else copied into it."""
    check(x, bias, p, seed, "bias_gelu_dropout backward")
    if dy.shape != x.shape:
        raise ValueError(f"bias_gelu_dropout backward: dy must have x's shape {tuple(x.shape)}, got {tuple(dy.shape)}")
    x, bias = (x if in_place(x) else x.contiguous()), bias.contiguous()
    if dy.dtype != x.dtype or (dy.stride() != x.stride() and not (dy.is_contiguous() and x.is_contiguous())):
        dy = torch.empty_like(x).copy_(dy)   # one copy, into x's layout and dtype
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols if n_cols else 0
    dx = torch.empty_like(x)
    if x.numel() == 0:
        return dx, torch.zeros_like(bias)
    grid = (-(-n_rows // block_m), -(-n_cols // block_n))
    partial = torch.empty((grid[0], n_cols), device=x.device, dtype=torch.float32)
    launch(bias_gelu_dropout_seeded_bwd_kernel, "bias_gelu_dropout_bwd", grid,
           (dy, x, bias, dx, partial, seed, n_rows, n_cols, float(p), 1.0 / (1.0 - float(p)), *_layout(x)),
           dict(BLOCK_M=block_m, BLOCK_N=block_n, DROPOUT=p > 0, STRIDED=not x.is_contiguous()))
    return dx, partial.sum(dim=0).to(bias.dtype)


def compile_cases(info):
    """The launches the compile matrix compiles for ``info`` (course_utils/aot.py), with and without dropout."""
    from ..aot import dtype_name, dtypes_for, empty
    seed = empty(1, dtype=torch.int64)
    for dt in dtypes_for(info):
        x, b = empty(1000, 3000, dtype=dt), empty(3000, dtype=dt)
        for p in (0.0, 0.1):
            yield (f"bias_gelu_dropout seeded {dtype_name(dt)} p={p}",
                   lambda x=x, b=b, p=p: bias_gelu_dropout(x, b, p, seed))
            yield (f"bias_gelu_dropout seeded backward {dtype_name(dt)} p={p}",
                   lambda x=x, b=b, p=p: bias_gelu_dropout_backward(x, x, b, p, seed))
        xt = empty(3000, 1000, dtype=dt).t()   # a dense layout: the strided forward, the STRIDED backward
        yield (f"bias_gelu_dropout seeded strided {dtype_name(dt)}",
               lambda xt=xt, b=b: bias_gelu_dropout(xt, b, 0.1, seed))
        yield (f"bias_gelu_dropout seeded strided backward {dtype_name(dt)}",
               lambda xt=xt, b=b: bias_gelu_dropout_backward(xt, xt, b, 0.1, seed))
