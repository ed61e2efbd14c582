"""Softmax along the last dimension (chapters 5 and 6): the kernels a student reads.

Version ladder:
  v1 ``softmax_ref``: five eager PyTorch ops (max, subtract, exp, sum, divide), five launches.
  v2 ``softmax_row_kernel`` / ``softmax_teaching``: fused, one row per program, the whole row in
     registers (``BLOCK_SIZE = next_power_of_2(N)``): one read and one write of HBM.
  v3 ``softmax_online_kernel`` / ``softmax_online_teaching``: rows of any length, one program per
     row; a running max and sum over tiles (the online recurrence of chapter 6), then a pass that
     writes; x is read twice.
  v4 ``course_utils.tuned.softmax.softmax`` (what ``make bench`` times): a plan per row length and
     device: several rows per program for N <= 16384, rows just over 16K as two blocks, long rows
     split over programs that share their (max, sum), v3 where none fits.

``softmax``, ``plan``, ``Plan``, ``occupancy``... live in ``course_utils.tuned.softmax``, which imports
this module; this module never imports it.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import env

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_TEACHING_BLOCK = 32768   # longest row (next power of two) softmax_teaching keeps in registers
MAX_GRID = 2**31 - 1         # CUDA's limit on the number of programs along axis 0


@triton.jit
def softmax_row_kernel(y_ptr, x_ptr, n_cols, x_row_stride, y_row_stride, BLOCK_SIZE: tl.constexpr):
    """v2: program ``pid`` normalizes row ``pid``; the whole row is one block of registers."""
    pid = tl.program_id(0)
    offsets = tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_cols
    # int64: pid * row_stride passes 2^31 once the tensor does (a 2^21 x 1024 input already).
    row_start = pid.to(tl.int64) * x_row_stride
    # -inf padding: masked lanes add exp(-inf) = 0 to the sum and never win the max.
    x = tl.load(x_ptr + row_start + offsets, mask=mask, other=-float("inf")).to(tl.float32)
    x = x - tl.max(x, axis=0)
    numerator = tl.exp(x)
    y = numerator / tl.sum(numerator, axis=0)
    tl.store(y_ptr + pid.to(tl.int64) * y_row_stride + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def softmax_online_kernel(y_ptr, x_ptr, n_cols, x_row_stride, y_row_stride, BLOCK_SIZE: tl.constexpr,
                          NUM_STAGES: tl.constexpr = 3):
    """v3: one program per row of any length.

    Pass 1 keeps a running max m and sum s per lane, rescaling s by exp(m_old - m_new) whenever the
    max grows; pass 2 writes exp(x - m) / s. The loops are ``for ... in tl.range(..., num_stages=)``:
    Triton's software pipeliner then loads the next NUM_STAGES - 1 tiles (async copies into shared
    memory) while this one is computed. It pipelines a loop without a ``tl.dot`` only when
    ``tl.range`` asks for stages, and never a ``while`` loop (sm_90 PTX: 0 async copies; see
    results/ptx/softmax_ptx.csv). The interpreter runs ``tl.range`` as a Python range.
    """
    pid = tl.program_id(0)
    x_row = x_ptr + pid.to(tl.int64) * x_row_stride
    y_row = y_ptr + pid.to(tl.int64) * y_row_stride
    offsets = tl.arange(0, BLOCK_SIZE)
    m = tl.full((BLOCK_SIZE,), -float("inf"), tl.float32)
    s = tl.zeros((BLOCK_SIZE,), tl.float32)
    for start in tl.range(0, n_cols, BLOCK_SIZE, num_stages=NUM_STAGES):
        cols = start + offsets
        x = tl.load(x_row + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        empty = m_new == -float("inf")  # nothing finite seen yet in this lane: keep s = 0
        correction = tl.where(empty, 0.0, tl.exp(m - m_new))
        s = s * correction + tl.where(empty, 0.0, tl.exp(x - m_new))
        m = m_new
    # Combine the lanes: the same rescaling, once more, towards the row's max.
    row_max = tl.max(m, axis=0)
    row_sum = tl.sum(tl.where(m == -float("inf"), 0.0, s * tl.exp(m - row_max)), axis=0)
    inv_sum = 1.0 / row_sum
    for start in tl.range(0, n_cols, BLOCK_SIZE, num_stages=NUM_STAGES):
        cols = start + offsets
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=-float("inf")).to(tl.float32)
        y = tl.exp(x - row_max) * inv_sum  # a row of all -inf gives NaN, as torch.softmax does
        tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------- plain launchers


def as_rows(x: torch.Tensor, what: str) -> torch.Tensor:
    """``x`` as a 2-D (rows, N) view of its last dimension, after checking what the kernels need."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in DTYPES:
        raise TypeError(f"{what}: expected float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"{what}: expected a tensor with at least one dimension, got a scalar")
    if x.device != env.DEVICE and not (x.device.type == env.DEVICE.type == "cuda"):
        raise ValueError(f"{what}: expected a tensor on {env.DEVICE} (mode {env.MODE}), got one on {x.device}")
    n_cols = x.shape[-1]
    if x.stride(-1) != 1 and n_cols > 1:  # rows may be strided (row_stride), columns must be contiguous
        x = x.contiguous()
    if x.dim() == 1:
        return x.unsqueeze(0)
    if x.numel() == 0:
        return x.reshape(math.prod(x.shape[:-1]), n_cols)
    try:
        return x.view(-1, n_cols)
    except RuntimeError:
        return x.reshape(-1, n_cols)


def _launch_rows(kernel, x: torch.Tensor, what: str, BLOCK_SIZE: int, num_warps: int) -> torch.Tensor:
    x2 = as_rows(x, what)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return y  # empty in, empty out, no launch
    n_rows, n_cols = x2.shape
    if n_rows > MAX_GRID:
        raise ValueError(f"{what}: {n_rows} rows is more programs than a grid holds ({MAX_GRID}); "
                         "course_utils.tuned.softmax.softmax takes several rows per program")
    y2 = y.view(n_rows, n_cols)
    kernel[(n_rows,)](y2, x2, n_cols, x2.stride(0), y2.stride(0), BLOCK_SIZE=BLOCK_SIZE, num_warps=num_warps)
    return y


def softmax_teaching(x: torch.Tensor) -> torch.Tensor:
    """v2: softmax over the last dim, one program per row, the row in registers (N <= 32768)."""
    n_cols = x.shape[-1] if isinstance(x, torch.Tensor) and x.dim() else 1
    block = triton.next_power_of_2(max(1, n_cols))
    if block > MAX_TEACHING_BLOCK:
        raise ValueError(f"softmax_teaching keeps a row in registers: {n_cols} columns is more than "
                         f"{MAX_TEACHING_BLOCK}; use softmax_online_teaching (v3) or softmax")
    # About 16 values per thread: 4 warps for 1024 columns, up to 32 warps (1024 threads, the most
    # a program can have) from 16384.
    num_warps = max(4, min(32, block // 512))
    return _launch_rows(softmax_row_kernel, x, "softmax_teaching", block, num_warps)


def softmax_online_teaching(x: torch.Tensor, BLOCK_SIZE: int = 1024) -> torch.Tensor:
    """v3: softmax over the last dim for rows of any length, tiles of BLOCK_SIZE (a power of two)."""
    if BLOCK_SIZE < 1 or BLOCK_SIZE & (BLOCK_SIZE - 1):
        raise ValueError(f"softmax_online_teaching: BLOCK_SIZE must be a power of two, got {BLOCK_SIZE}")
    return _launch_rows(softmax_online_kernel, x, "softmax_online_teaching", BLOCK_SIZE, 4 if BLOCK_SIZE <= 2048 else 8)


def softmax_ref(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """v1: the five-op eager softmax (max, subtract, exp, sum, divide): five kernels, five passes."""
    row_max = x.amax(dim=dim, keepdim=True)
    shifted = x - row_max
    numerator = torch.exp(shifted)
    denominator = numerator.sum(dim=dim, keepdim=True)
    return numerator / denominator


def compile_cases(info):
    """The launches ``python -m course_utils.aot`` compiles for ``info`` (tuned ones: tuned/softmax.py)."""
    from ..aot import dtype_name, dtypes_for, empty
    for dt in dtypes_for(info):
        for n in (1000, 4096, 32768):
            yield f"softmax_teaching {dtype_name(dt)} N={n}", lambda n=n, dt=dt: softmax_teaching(empty(8, n, dtype=dt))
        yield (f"softmax_online_teaching {dtype_name(dt)}",
               lambda dt=dt: softmax_online_teaching(empty(4, 100_000, dtype=dt)))
    # past 2^31 elements (nothing is allocated): the int64 row offsets compile
    yield "softmax_teaching 2^31+", lambda: softmax_teaching(empty(2**21 + 1, 1024, dtype=torch.float16))


# --------------------------------------------------------------------------- old names
_softmax_row_kernel = softmax_row_kernel        # old names of the two teaching kernels
_softmax_online_kernel = softmax_online_kernel
