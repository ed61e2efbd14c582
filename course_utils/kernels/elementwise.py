"""Elementwise kernels (chapters 3 and 4): vector add, GELU, and the chains fused around GELU.

Version ladder:
- v0 eager PyTorch (the ``*_ref`` functions): one kernel per operator, every intermediate through HBM.
- v1 ``add_kernel``: one program per BLOCK_SIZE tile of a flat tensor, the partial last tile masked.
- v2 ``gelu_kernel``: tanh approximation (as ``x / (1 + e^(-2a))``, the stable form of the tanh) or
  exact erf, fp32 math, one read and one write.
- v3 ``bias_gelu_scale_kernel``: ``gelu(x + bias) * scale`` (bias per column, scalar scale), one read, one write.
- v4 ``bias_gelu_dropout_kernel``: ``dropout(gelu(x + bias), p)`` with the keep mask drawn inside the
  kernel (Philox, from the seed and the element's index): no mask tensor is ever stored or read.
  ``keep_mask_kernel`` writes that same mask out, for the references and the checks.

The shelf a student reads: kernels, plain ``kernel[grid](...)`` launchers (``*_teaching``), references.
Offsets are int64 (``pid.to(tl.int64)``): correct past 2^31 elements. The path ``make bench`` times (tiles
per GPU, int32 offsets where safe, cheaper bias loads) is :mod:`course_utils.tuned.elementwise`, which
imports this shelf; this shelf never imports it. Inputs of any dense layout: :mod:`.layouts`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .. import env

SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)   # sqrt(2 / pi)
INV_SQRT_2 = tl.constexpr(0.7071067811865476)       # 1 / sqrt(2)
GELU_CUBIC = tl.constexpr(0.044715)
TEACHING_BLOCK = 1024                                # elements per program of the *_teaching launchers

# --- Kernels -----------------------------------------------------------------------------------


@triton.jit
def gelu_math(x, APPROXIMATE: tl.constexpr):
    """GELU of a float32 block: tanh approximation if APPROXIMATE else exact (erf).

    gelu(x) = 0.5 x (1 + tanh(a)), a = sqrt(2/pi) (x + 0.044715 x^3). Since 0.5 (1 + tanh(a)) = 1 / (1 + e^(-2a)),
    this is x / (1 + e^(-2a)): one exp and one division, no cancellation where tanh(a) is near -1, and
    e^(-2a) = inf for very negative x gives x / inf = -0, the right limit. On a GPU ``/`` on float32 compiles
    to ``div.full.f32`` (an approximate division, within 2 ulp); ``tl.fdiv`` compiles to the same instruction,
    and ``tl.math.div_rn`` is the correctly rounded one (Triton 3.6, sm_90). Triton has a tanh on the GPU,
    ``triton.language.extra.libdevice.tanh``, but the interpreter refuses extern (libdevice) calls, so this
    kernel, which must also run on a laptop, builds it from ``exp``.
    """
    if APPROXIMATE:
        a = SQRT_2_OVER_PI * (x + GELU_CUBIC * x * x * x)
        y = x / (1.0 + tl.exp(-2.0 * a))
    else:
        y = 0.5 * x * (1.0 + tl.math.erf(x * INV_SQRT_2))
    return y


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(axis=0)
    # int64 before the multiply: pid * BLOCK_SIZE in int32 wraps past 2^31 elements
    offsets = pid.to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements                       # the last tile may run past the end
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    y = tl.load(y_ptr + offsets, mask=mask).to(tl.float32)
    tl.store(out_ptr + offsets, (x + y).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gelu_kernel(x_ptr, y_ptr, n_elements, BLOCK_SIZE: tl.constexpr, APPROXIMATE: tl.constexpr):
    pid = tl.program_id(axis=0)
    offsets = pid.to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)      # one read of x
    y = gelu_math(x, APPROXIMATE)                                # everything else in registers
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)  # one write of y


@triton.jit
def bias_gelu_scale_kernel(x_ptr, bias_ptr, y_ptr, n_elements, n_cols, scale, BLOCK_SIZE: tl.constexpr,
                           APPROXIMATE: tl.constexpr):
    pid = tl.program_id(axis=0)
    offsets = pid.to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    cols = offsets % n_cols                                      # the bias is one value per column
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    b = tl.load(bias_ptr + cols, mask=mask).to(tl.float32)      # n_cols values: they stay in L2
    y = gelu_math(x + b, APPROXIMATE) * tl.cast(scale, tl.float32)  # torch.compile passes fp64: math in float32
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["seed"])
def bias_gelu_dropout_kernel(x_ptr, bias_ptr, y_ptr, n_elements, n_cols, p, seed, BLOCK_SIZE: tl.constexpr,
                             APPROXIMATE: tl.constexpr):
    p = tl.cast(p, tl.float32)  # fp64 from torch.compile: float32 (tl.cast: the interpreter passes a Python float)
    pid = tl.program_id(axis=0)
    offsets = pid.to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    cols = offsets % n_cols
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    b = tl.load(bias_ptr + cols, mask=mask).to(tl.float32)
    y = gelu_math(x + b, APPROXIMATE)
    r = tl.rand(seed, offsets)                                   # uniform [0, 1): a function of (seed, index)
    y = tl.where(r >= p, y / (1.0 - p), 0.0)                     # keep with probability 1 - p, rescale
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["seed"])
def keep_mask_kernel(keep_ptr, n_elements, p, seed, BLOCK_SIZE: tl.constexpr):
    """The keep mask of :func:`bias_gelu_dropout_kernel` as int8 (1 kept, 0 dropped): same (seed, index)."""
    pid = tl.program_id(axis=0)
    offsets = pid.to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    tl.store(keep_ptr + offsets, (tl.rand(seed, offsets) >= tl.cast(p, tl.float32)).to(tl.int8), mask=mask)


# --- Plain launchers: check, allocate, one kernel[grid](...) call --------------------------------

def _check(name: str, t, like: torch.Tensor | None = None, copy: bool = False, dense: bool = False) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != env.DEVICE.type:
        raise ValueError(f"{name} is on {t.device}, but the kernels run on {env.DEVICE.type}: use {name}.to(cu.DEVICE)")
    if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"{name} has dtype {t.dtype}; expected float32, float16 or bfloat16")
    if like is not None and t.dtype != like.dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but x has {like.dtype}: pass them in the same dtype")
    if not t.is_contiguous() and not (dense and layouts.in_place(t)):  # dense: read in place, y in its strides
        if not copy:
            raise ValueError(f"{name} is not contiguous: the kernels index it as one flat array ({name}.contiguous())")
        t = t.contiguous()  # a transposed or sliced x: one copy, then the flat kernel (an extra read and write)
    return t


def _check_bias(x: torch.Tensor, bias) -> int:
    _check("bias", bias, like=x)
    if x.dim() == 0 or bias.dim() != 1 or bias.shape[0] != x.shape[-1]:
        raise ValueError(f"bias must be 1-D with one value per column of x (x.shape = {tuple(x.shape)}), "
                         f"got shape {tuple(bias.shape)}")
    return bias.shape[0]


def _approximate(approximate: str) -> bool:
    if approximate not in ("tanh", "none"):
        raise ValueError(f"approximate must be 'tanh' or 'none' (exact erf), got {approximate!r}")
    return approximate == "tanh"


def _check_dropout(p: float, seed: int) -> None:
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability p must be in [0, 1), got {p}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an int in [0, 2^63), got {seed!r}")


def add_teaching(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x + y`` with :func:`add_kernel`: one program per BLOCK_SIZE elements."""
    _check("x", x)
    _check("y", y, like=x)
    if x.shape != y.shape:
        raise ValueError(f"x and y must have the same shape, got {tuple(x.shape)} and {tuple(y.shape)}")
    out = torch.empty_like(x)
    n = x.numel()
    if n > 0:                                                    # empty in, empty out, no launch
        add_kernel[(triton.cdiv(n, TEACHING_BLOCK),)](x, y, out, n, BLOCK_SIZE=TEACHING_BLOCK)
    return out


def gelu_teaching(x: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """GELU of ``x`` with :func:`gelu_kernel` (``approximate``: 'tanh' or 'none').

    A dense x of any strides and ``torch.empty_like(x)`` are flat blocks with the same strides: the flat
    kernel walks both, y keeps x's layout. A slice with gaps (``x[:, ::2]``) is copied once (y contiguous)."""
    flag = _approximate(approximate)
    x = _check("x", x, copy=True, dense=True)
    y = torch.empty_like(x)
    n = x.numel()
    if n > 0:
        gelu_kernel[(triton.cdiv(n, TEACHING_BLOCK),)](x, y, n, BLOCK_SIZE=TEACHING_BLOCK, APPROXIMATE=flag)
    return y


def bias_gelu_scale_teaching(x: torch.Tensor, bias: torch.Tensor, scale: float,
                             approximate: str = "tanh") -> torch.Tensor:
    """``gelu(x + bias) * scale`` with :func:`bias_gelu_scale_kernel` (a dense strided x: see layouts.py)."""
    flag = _approximate(approximate)
    x = _check("x", x, copy=True, dense=True)
    n_cols = _check_bias(x, bias)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number, got {scale}")
    y = torch.empty_like(x)
    n = x.numel()
    if n > 0 and not x.is_contiguous():
        layouts.bias_gelu_strided(x, bias, y, scale, 0.0, approximate=flag)
    elif n > 0:
        bias_gelu_scale_kernel[(triton.cdiv(n, TEACHING_BLOCK),)](x, bias, y, n, n_cols, float(scale),
                                                              BLOCK_SIZE=TEACHING_BLOCK, APPROXIMATE=flag)
    return y


def bias_gelu_dropout_teaching(x: torch.Tensor, bias: torch.Tensor, p: float, seed: int,
                               approximate: str = "tanh") -> torch.Tensor:
    """``dropout(gelu(x + bias), p)`` with :func:`bias_gelu_dropout_kernel`; the mask comes from ``seed``.

    Element i is kept when Philox(seed, i) >= p, then scaled by 1 / (1 - p). Use a new seed for
    every call, layer and training step: the same seed draws the same mask. i is the logical index
    (a dense strided x, read in place by layouts.py's kernel, gets x.contiguous()'s mask).
    """
    flag = _approximate(approximate)
    x = _check("x", x, copy=True, dense=True)
    n_cols = _check_bias(x, bias)
    _check_dropout(p, seed)
    y = torch.empty_like(x)
    n = x.numel()
    if n > 0 and not x.is_contiguous():
        layouts.bias_gelu_strided(x, bias, y, 1.0, float(p), seed, approximate=flag, times_inverse=False)
    elif n > 0:
        bias_gelu_dropout_kernel[(triton.cdiv(n, TEACHING_BLOCK),)](x, bias, y, n, n_cols, float(p), seed,
                                                                BLOCK_SIZE=TEACHING_BLOCK, APPROXIMATE=flag)
    return y


def dropout_keep_mask_teaching(shape, p: float, seed: int, device=None) -> torch.Tensor:
    """The boolean keep mask that :func:`bias_gelu_dropout_kernel` draws for ``shape``, ``p`` and ``seed``."""
    _check_dropout(p, seed)
    keep = torch.empty(tuple(shape), dtype=torch.int8, device=env.DEVICE if device is None else device)
    n = keep.numel()
    if n > 0:
        keep_mask_kernel[(triton.cdiv(n, TEACHING_BLOCK),)](keep, n, float(p), seed, BLOCK_SIZE=TEACHING_BLOCK)
    return keep.bool()


# --- PyTorch references (eager, unfused: one kernel per operator) -------------------------------

def add_ref(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x + y


def gelu_ref(x: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """GELU written operator by operator, as a student would in eager PyTorch (9 kernels for tanh)."""
    if approximate == "tanh":
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))
    if approximate == "none":
        return 0.5 * x * (1.0 + torch.erf(x * (1.0 / math.sqrt(2.0))))
    raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")


def bias_gelu_scale_ref(x: torch.Tensor, bias: torch.Tensor, scale: float, approximate: str = "tanh"):
    """The eager chain: add, F.gelu, mul (three kernels, two intermediates through HBM)."""
    return F.gelu(x + bias, approximate=approximate) * scale


def bias_gelu_dropout_ref(x: torch.Tensor, bias: torch.Tensor, p: float, seed: int,
                          approximate: str = "tanh"):
    """The eager chain with the fused kernels' own mask (torch's dropout draws other numbers)."""
    keep = dropout_keep_mask_teaching(x.shape, p, seed, device=x.device)
    return F.gelu(x + bias, approximate=approximate) * keep.to(x.dtype) / (1.0 - p)


from . import layouts  # noqa: E402  (imported last: layouts.py imports gelu_math from here)
