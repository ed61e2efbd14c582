"""The backward of bias + GELU (+ dropout) (chapter 11): one read of what the forward read, no mask stored.

Forward (chapter 4): ``y = dropout(gelu(x + b), p)``, with the keep mask drawn inside the kernel from
``(seed, flat index)``. Backward, with ``z = x + b`` and ``keep`` that mask:

    dz = dy * gelu'(z) * keep / (1 - p)        dx = dz        db = sum of dz over the rows

Version ladder:
- v0 autograd through the eager ops (:func:`bias_gelu_backward_ref`): the forward saves ``z``, the
  GELU output and a 1-byte mask; the backward reads them back in several kernels.
- v1 :func:`bias_gelu_backward_teaching`: one program per (BLOCK_M x BLOCK_N) tile recomputes ``z``
  from ``x`` and ``b``, regenerates the keep mask from the seed (the same Philox numbers as the
  forward: nothing was stored), writes ``dx`` and one partial column sum per tile; a second, tiny
  reduction over the tiles' partial sums gives ``db`` (deterministic, unlike atomics).
- v2 any dense layout of x (``STRIDED``): the tile's rows and columns are logical, their addresses
  come from x's strides (:func:`course_utils.kernels.layouts.row_offsets`), dx gets x's strides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .layouts import NO_LAYOUT, is_dense, lead_layout, row_offsets

SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)   # sqrt(2 / pi)
INV_SQRT_2 = tl.constexpr(0.7071067811865476)       # 1 / sqrt(2)
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)     # 1 / sqrt(2 pi)
GELU_CUBIC = tl.constexpr(0.044715)
SATURATION = tl.constexpr(20.0)  # |z| past which gelu'(z) is exactly 0 or 1 in float32 (both forms)


@triton.jit
def gelu_grad(z, APPROXIMATE: tl.constexpr):
    """gelu'(z) of a float32 block.

    tanh form: gelu(z) = z * s with s = 1 / (1 + e^(-2a)), a = sqrt(2/pi) (z + 0.044715 z^3), so
        gelu'(z) = s + z * 2 s (1 - s) * sqrt(2/pi) (1 + 3 * 0.044715 z^2).
    erf form: gelu(z) = z Phi(z), so gelu'(z) = Phi(z) + z phi(z).
    z is clamped to +-20 first: there the result is already exactly 1 or 0, and the clamp keeps
    z^3 from overflowing into 0 * inf = NaN for huge inputs.
    """
    z = tl.minimum(tl.maximum(z, -SATURATION), SATURATION)
    if APPROXIMATE:
        a = SQRT_2_OVER_PI * (z + GELU_CUBIC * z * z * z)
        s = 1.0 / (1.0 + tl.exp(-2.0 * a))
        d = s + z * 2.0 * s * (1.0 - s) * SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_CUBIC * z * z)
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(z * INV_SQRT_2))
        d = cdf + z * tl.exp(-0.5 * z * z) * INV_SQRT_2PI
    return d


@triton.jit(do_not_specialize=["seed"])
def bias_gelu_backward_kernel(dy_ptr, x_ptr, bias_ptr, dx_ptr, db_partial_ptr, n_rows, n_cols,
                              p, keep_scale, seed, n1, n2, s0, s1, s2, r0, r1, r2, col_stride,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, APPROXIMATE: tl.constexpr,
                              DROPOUT: tl.constexpr, STRIDED: tl.constexpr):
    # torch.compile passes floats as fp64: keep the math in float32 (tl.cast: the interpreter passes a Python float)
    p, keep_scale = tl.cast(p, tl.float32), tl.cast(keep_scale, tl.float32)
    pid_m = tl.program_id(axis=0)
    pid_n = tl.program_id(axis=1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    mask = (rows[:, None] < n_rows) & col_mask[None, :]
    # The forward's flat index (rows x n_cols, contiguous), in int64: past 2^31 elements too.
    offsets = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
    addr = offsets                   # contiguous: the address is the flat index
    if STRIDED:                      # x, dy and dx share one dense layout: addresses from x's strides
        offset, row = row_offsets(rows.to(tl.int64), n1, n2, s0, s1, s2, r0, r1, r2)
        addr = offset[:, None] + cols.to(tl.int64)[None, :] * col_stride
        offsets = row[:, None] * n_cols + cols[None, :]       # the tile's rows in memory order: their logical index
    x = tl.load(x_ptr + addr, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + addr, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dz = dy * gelu_grad(x + b[None, :], APPROXIMATE)             # z = x + b recomputed, never stored
    if DROPOUT:
        r = tl.rand(seed, offsets)                               # the forward's numbers, regenerated
        dz = tl.where(r >= p, dz * keep_scale, 0.0)
    tl.store(dx_ptr + addr, dz.to(dx_ptr.dtype.element_ty), mask=mask)
    partial = tl.sum(tl.where(mask, dz, 0.0), axis=0)           # this tile's share of db
    tl.store(db_partial_ptr + pid_m * n_cols + cols, partial, mask=col_mask)


DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor, p: float) -> None:
    for name, t in (("dy", dy), ("x", x), ("bias", bias)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in DTYPES:
            raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}: put all tensors on one device")
    if not bias.is_contiguous():
        raise ValueError("bias must be contiguous (call .contiguous() first)")
    if not is_dense(x) or lead_layout(x) is None:
        raise ValueError(f"x must be dense in memory (contiguous, transposed or permuted, at most 4 dims after "
                         f"merging), got strides {tuple(x.stride())}: call .contiguous() first")
    if dy.stride() != x.stride() and not (dy.is_contiguous() and x.is_contiguous()):
        raise ValueError(f"dy must have x's strides {tuple(x.stride())}, got {tuple(dy.stride())}: "
                         "torch.empty_like(x).copy_(dy) gives it them")
    if x.dim() < 1 or dy.shape != x.shape:
        raise ValueError(f"dy must have x's shape {tuple(x.shape)}, got {tuple(dy.shape)}")
    if bias.dim() != 1 or bias.numel() != x.shape[-1]:
        raise ValueError(f"bias must be 1-D with {x.shape[-1]} values (x's last dim), got shape {tuple(bias.shape)}")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability p must be in [0, 1), got {p}")


def bias_gelu_backward_teaching(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor, *, p: float = 0.0,
                                seed: int = 0, approximate: str = "tanh", BLOCK_M: int = 32,
                                BLOCK_N: int = 64, dx: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, db)`` of ``y = dropout(gelu(x + bias), p)`` (``p=0``: no dropout), from ``dy``.

    ``seed`` and ``p`` must be the forward's. ``x`` has any shape whose last dim is ``bias``'s length,
    in any dense layout (dy in the same one); dx has x's strides. ``dx`` (optional) is an output of
    x's shape, dtype and strides to write into.
    """
    if approximate not in ("tanh", "none"):
        raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
    _check(dy, x, bias, p)
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols if n_cols else 0
    if dx is None:
        dx = torch.empty_like(x)
    elif dx.shape != x.shape or dx.dtype != x.dtype or dx.device != x.device or \
            (dx.stride() != x.stride() and not (dx.is_contiguous() and x.is_contiguous())):
        raise ValueError(f"dx must be a {x.dtype} tensor of shape {tuple(x.shape)} and strides {tuple(x.stride())} "
                         f"on {x.device}")
    if x.numel() == 0:
        return dx, torch.zeros_like(bias)
    grid = (triton.cdiv(n_rows, BLOCK_M), triton.cdiv(n_cols, BLOCK_N))
    partial = torch.empty((grid[0], n_cols), device=x.device, dtype=torch.float32)
    keep_scale = 1.0 / (1.0 - p)
    bias_gelu_backward_kernel[grid](dy, x, bias, dx, partial, n_rows, n_cols, p, keep_scale, seed,
                                    *(NO_LAYOUT if x.is_contiguous() else lead_layout(x)),
                                    BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, APPROXIMATE=approximate == "tanh",
                                    DROPOUT=p > 0.0, STRIDED=not x.is_contiguous())
    return dx, partial.sum(dim=0).to(bias.dtype)    # the second reduction: grid[0] rows of partial sums


def bias_gelu_backward_ref(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor, *, keep: torch.Tensor | None = None,
                           p: float = 0.0, approximate: str = "tanh") -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, db)`` by autograd through the eager ops, in the inputs' dtype (float64 in, float64 out).

    ``keep`` is the forward's boolean keep mask (``None``: no dropout)."""
    x = x.detach().requires_grad_(True)
    bias = bias.detach().requires_grad_(True)
    y = torch.nn.functional.gelu(x + bias, approximate=approximate)
    if keep is not None:
        y = torch.where(keep.bool(), y / (1.0 - p), torch.zeros_like(y))
    dx, db = torch.autograd.grad(y, (x, bias), dy)
    return dx, db


def compile_cases(info):
    """The launches the compile matrix compiles for ``info`` (see course_utils/aot.py)."""
    from ..aot import dtype_name, dtypes_for, empty
    for dt in dtypes_for(info):
        x = empty(1000, 3000, dtype=dt)
        for p in (0.0, 0.1):
            yield (f"bias_gelu_backward {dtype_name(dt)} p={p}",
                   lambda x=x, p=p: bias_gelu_backward_teaching(x, x, x[0], p=p, seed=1))
        xt = empty(40, 300, 7, dtype=dt).permute(0, 2, 1)     # a dense layout: the STRIDED addresses
        yield (f"bias_gelu_backward strided {dtype_name(dt)}",
               lambda xt=xt: bias_gelu_backward_teaching(xt, xt, empty(300, dtype=dt), p=0.1, seed=1))
        yield (f"bias_gelu_backward erf {dtype_name(dt)}",
               lambda dt=dt: bias_gelu_backward_teaching(empty(7, 13, dtype=dt), empty(7, 13, dtype=dt),
                                                         empty(13, dtype=dt), approximate="none"))
