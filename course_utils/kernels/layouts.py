"""Elementwise ops on inputs of any dense layout (transposed, permuted, channels-last), output in that layout.

PyTorch's elementwise ops return their output in the input's memory format (``torch.empty_like``):
a permuted x gives a permuted y. A tensor whose elements fill one block of memory without gaps
(*dense*) needs no copy for that. What an op must know is which logical element each memory address
holds, wherever the logical index matters: the bias is per column (x's last dim), and the dropout
mask is drawn from Philox(seed, logical flat index), so a permuted x gets the mask the contiguous x
gets (the backward regenerates it the same way).

Version ladder (the layouts of chapter 4's ``bias_gelu_dropout_kernel``):
- v1 a non-contiguous x is copied once (``x.contiguous()``) and the output is contiguous.
- v2 :func:`bias_gelu_strided_kernel`: tiles of BLOCK_M rows x BLOCK_N columns; each row's address
  and logical index come from its coordinates in x's leading dims (:func:`row_offsets`, once per row,
  not per element), each column's address from x's last stride. Reads x and writes y in place, in x's
  strides. The tile's rows walk the leading dims smallest stride innermost (:func:`lead_layout`), so
  where x's last dim is not the fastest in memory (a transpose, channels-last) neighbouring rows of a
  tile are neighbours in memory and each row is read with a stride; whether that beats copying x first
  is for a GPU to say (``tools/gpu_checks/elementwise_layouts.py`` times both; not measured yet).

Pure GELU needs no index at all: a dense x and ``torch.empty_like(x)`` are flat blocks of memory with
the same strides, and the flat GELU kernel walks both in memory order (``gelu_teaching``, tuned ``gelu``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .elementwise import gelu_math

MAX_LEAD_DIMS = 3       # leading dims (after merging) that row_offsets takes; more: the launcher copies
STRIDED_BLOCK_M = 16    # rows per tile of bias_gelu_strided_kernel
STRIDED_BLOCK_N = 64    # columns per tile


@triton.jit
def row_offsets(rows, n1, n2, s0, s1, s2, r0, r1, r2):
    """Memory offset and logical row of each tile row ``rows`` (int64). A tile row walks x's leading
    dims in the order :func:`lead_layout` chose (the smallest stride innermost, so that neighbouring
    tile rows are neighbours in memory): rows = (i0 * n1 + i1) * n2 + i2, offset = i0 s0 + i1 s1 + i2 s2,
    logical row (x.view(-1, n_cols)'s) = i0 r0 + i1 r1 + i2 r2."""
    i2 = rows % n2
    rest = rows // n2
    i1 = rest % n1
    i0 = rest // n1
    return i0 * s0 + i1 * s1 + i2 * s2, i0 * r0 + i1 * r1 + i2 * r2


@triton.jit(do_not_specialize=["seed"])
def bias_gelu_strided_kernel(x_ptr, bias_ptr, y_ptr, seed_ptr, n_rows, n_cols, n1, n2, s0, s1, s2, r0, r1, r2,
                             col_stride, scale, p, keep_scale, seed, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             APPROXIMATE: tl.constexpr, DROPOUT: tl.constexpr, SEED_IN_MEMORY: tl.constexpr,
                             TIMES_INVERSE: tl.constexpr):
    """``y = dropout(gelu(x + bias), p) * scale`` of a dense x of any strides, y with x's strides.
    The mask is Philox(seed, row * n_cols + col): the logical index, whatever the layout.
    SEED_IN_MEMORY: the seed is read from ``seed_ptr`` (a CUDA graph replay sees the new value).
    TIMES_INVERSE: kept values times keep_scale = 1 / (1 - p), as the tuned kernels do, else divided by
    1 - p, as the teaching kernel does (the same bits as the contiguous path of each shelf)."""
    # torch.compile passes floats as fp64: keep the math in float32 (tl.cast: the interpreter passes a Python float)
    scale, p, keep_scale = tl.cast(scale, tl.float32), tl.cast(p, tl.float32), tl.cast(keep_scale, tl.float32)
    rows = tl.program_id(axis=0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(axis=1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    offset, row = row_offsets(rows, n1, n2, s0, s1, s2, r0, r1, r2)
    addr = offset[:, None] + cols.to(tl.int64)[None, :] * col_stride
    x = tl.load(x_ptr + addr, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    y = gelu_math(x + b[None, :], APPROXIMATE) * scale
    if DROPOUT:
        if SEED_IN_MEMORY:
            seed = tl.load(seed_ptr)
        index = row[:, None] * n_cols + cols[None, :]            # the logical flat index, int64
        kept = y * keep_scale if TIMES_INVERSE else y / (1.0 - p)
        y = tl.where(tl.rand(seed, index) >= p, kept, 0.0)
    tl.store(y_ptr + addr, y.to(y_ptr.dtype.element_ty), mask=mask)


# --- Host side: which layouts these kernels read in place ---------------------------------------

def is_dense(t: torch.Tensor) -> bool:
    """True when ``t``'s elements fill one block of memory without gaps or overlaps (contiguous, or a
    transpose or permutation of a contiguous tensor): ``torch.empty_like(t)`` then has t's strides."""
    expect = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1):
        if stride != expect:
            return False
        expect *= size
    return True


def lead_layout(t: torch.Tensor) -> tuple[int, ...] | None:
    """``(n1, n2, s0, s1, s2, r0, r1, r2, col_stride)`` for :func:`row_offsets`: t's leading dims, merged
    where one steps through memory (and through the logical rows) as the next does, at most
    MAX_LEAD_DIMS of them (n0 is implied), ordered by decreasing memory stride, with their memory
    strides s and logical row strides r; and the stride of t's last dim. None when more dims remain
    (the launcher copies)."""
    lead = t.shape[:-1]
    row_strides = [1] * len(lead)
    for d in range(len(lead) - 2, -1, -1):            # x.view(-1, n_cols)'s row index, row-major
        row_strides[d] = row_strides[d + 1] * lead[d + 1]
    merged: list[list[int]] = []
    for n, s, r in zip(lead, t.stride()[:-1], row_strides):
        if n == 1:
            continue
        if merged and merged[-1][1] == s * n:          # the outer dim steps over exactly this one
            merged[-1] = [merged[-1][0] * n, s, r]
        else:
            merged.append([n, s, r])
    if len(merged) > MAX_LEAD_DIMS:
        return None
    merged = [[1, 0, 0]] * (MAX_LEAD_DIMS - len(merged)) + sorted(merged, key=lambda d: -d[1])
    (_, s0, r0), (n1, s1, r1), (n2, s2, r2) = merged
    return n1, n2, s0, s1, s2, r0, r1, r2, t.stride(-1) if t.dim() else 1


NO_LAYOUT = (1, 1, 0, 0, 0, 0, 0, 0, 1)   # the layout arguments of a STRIDED=False launch (unused)


def in_place(x: torch.Tensor) -> bool:
    """True when the course's elementwise launchers read x where it lies: contiguous, or dense with
    leading dims :func:`row_offsets` addresses. Any other x is copied once (``x.contiguous()``)."""
    return x.is_contiguous() or (is_dense(x) and lead_layout(x) is not None)


def output_like(x: torch.Tensor) -> torch.Tensor:
    """The output an elementwise op of x returns: x's strides when the op reads x in place
    (``torch.empty_like``), else contiguous (x was copied). Fake (meta) implementations return the same."""
    return torch.empty_like(x) if in_place(x) else torch.empty(x.shape, dtype=x.dtype, device=x.device)


def bias_gelu_strided(x: torch.Tensor, bias: torch.Tensor, y: torch.Tensor, scale: float, p: float,
                      seed: int = 0, seed_tensor: torch.Tensor | None = None, approximate: bool = True,
                      times_inverse: bool = True) -> None:
    """Launch :func:`bias_gelu_strided_kernel` on x (dense, any strides) into y (x's strides)."""
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols
    grid = (triton.cdiv(n_rows, STRIDED_BLOCK_M), triton.cdiv(n_cols, STRIDED_BLOCK_N))
    seed_ptr = y if seed_tensor is None else seed_tensor   # read only when SEED_IN_MEMORY
    bias_gelu_strided_kernel[grid](x, bias, y, seed_ptr, n_rows, n_cols, *lead_layout(x),
                                   float(scale), float(p), 1.0 / (1.0 - float(p)), int(seed), BLOCK_M=STRIDED_BLOCK_M,
                                   BLOCK_N=STRIDED_BLOCK_N, APPROXIMATE=approximate, DROPOUT=p > 0.0,
                                   SEED_IN_MEMORY=seed_tensor is not None, TIMES_INVERSE=times_inverse)


def compile_cases(info):
    """The launches the compile matrix compiles for ``info`` (see course_utils/aot.py)."""
    from ..aot import dtype_name, dtypes_for, empty
    for dt in dtypes_for(info):
        x = empty(8, 33, 5, 40, dtype=dt).permute(0, 2, 3, 1)          # channels-last-like
        b = empty(33, dtype=dt)
        for p in (0.0, 0.1):
            yield (f"bias_gelu_strided {dtype_name(dt)} p={p}",
                   lambda x=x, b=b, p=p: bias_gelu_strided(x, b, torch.empty_like(x), 1.0, p, 7))
        seed = empty(1, dtype=torch.int64)
        yield (f"bias_gelu_strided {dtype_name(dt)} seed in memory",
               lambda x=x, b=b: bias_gelu_strided(x, b, torch.empty_like(x), 1.0, 0.1, 0, seed))
    big = empty(1024, 2**21, dtype=torch.float16).t()   # 2^31 elements, transposed: int64 rows and addresses
    yield "bias_gelu_strided 2^31", lambda: bias_gelu_strided(big, empty(1024, dtype=torch.float16),
                                                              torch.empty_like(big), 1.0, 0.1, 7)
