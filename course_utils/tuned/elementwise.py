"""The tuned elementwise path (what ``make bench`` times): ``add``, ``gelu``, ``bias_gelu_scale``,
``bias_gelu_dropout`` and ``dropout_keep_mask``.

The kernels compute what the teaching kernels of :mod:`course_utils.kernels.elementwise` compute,
with the same ``gelu_math`` and the same dropout mask, and differ in three ways: tiles chosen per
GPU (:func:`~course_utils.tuned.elementwise_config.launch_config`); int32 offsets, cheaper, unless a
tensor comes within reach of 2^31 elements (``INT64``); one modulo per program for the bias column
instead of one per element (``WRAPS``, :func:`bias_columns`). Inputs are float32, float16 or
bfloat16 (bfloat16 from sm_80 on); the math is float32, the output has the input's dtype.

Every call is Triton's ordinary ``kernel[grid](...)``, with the device, launch configuration and
validated (dtype, device) pairs remembered; replay small calls from a CUDA graph (course_utils.graphs).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import env
from ..kernels.elementwise import gelu_math, keep_mask_kernel  # the mask kernel is the teaching one
from ..kernels.layouts import bias_gelu_strided
from .elementwise_config import (  # noqa: F401  (names users import from here)
    DROPOUT_MAX_BLOCK,
    FLOAT_DTYPES,
    INT64_THRESHOLD,
    MAX_BLOCK_SIZE,
    LaunchConfig,
    _approximate_flag,
    _check_bias,
    _check_tensor,
    _flat,
    _output,
    _same,
    config_for,
    dense_in_memory,
    device_of,
    dropout_args,
    input_dtypes,
    launch_config,
    needs_int64,
    rows_of,
)
from .launch import launch, traced

# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def tile_start(pid, BLOCK_SIZE: tl.constexpr, INT64: tl.constexpr):
    """First element of program ``pid``'s tile; int64 when pid * BLOCK_SIZE could pass 2^31 - 1."""
    if INT64:
        pid = pid.to(tl.int64)
    return pid * BLOCK_SIZE


# How a tile of BLOCK_SIZE flat indices meets rows of n_cols (the WRAPS constexpr of the bias kernels)
IN_ROW, ONE_WRAP, ANY_WRAP = 0, 1, 2


def bias_wraps(block_size: int, n_cols: int) -> int:
    """IN_ROW when every tile lies inside one row, ONE_WRAP when a tile crosses at most one row
    end, ANY_WRAP otherwise (rows shorter than a tile)."""
    if n_cols % block_size == 0:
        return IN_ROW
    return ONE_WRAP if block_size <= n_cols else ANY_WRAP


@triton.jit
def bias_columns(start, n_cols, BLOCK_SIZE: tl.constexpr, WRAPS: tl.constexpr):
    """Column of each element of the tile that starts at flat index ``start`` (rows of n_cols).

    One modulo per program, not one per element (an integer division by a value known only at run
    time costs about twenty instructions). Inside one row the columns are consecutive and the
    tile's first one is a multiple of BLOCK_SIZE, which the hints tell the compiler so the bias
    loads are as wide as the loads of x.
    """
    cols = start % n_cols + tl.arange(0, BLOCK_SIZE)
    if WRAPS == 0:    # IN_ROW (a jit function reads module globals only as constexprs: plain ints here)
        cols = tl.max_contiguous(tl.multiple_of(cols, BLOCK_SIZE), BLOCK_SIZE)
    elif WRAPS == 1:  # ONE_WRAP
        cols = tl.where(cols >= n_cols, cols - n_cols, cols)
    else:
        cols = cols % n_cols
    return cols


@triton.jit
def add_tuned_kernel(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr, INT64: tl.constexpr):
    offsets = tile_start(tl.program_id(axis=0), BLOCK_SIZE, INT64) + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    y = tl.load(y_ptr + offsets, mask=mask).to(tl.float32)
    tl.store(out_ptr + offsets, (x + y).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gelu_tuned_kernel(x_ptr, y_ptr, n_elements, BLOCK_SIZE: tl.constexpr, APPROXIMATE: tl.constexpr,
                      INT64: tl.constexpr):
    offsets = tile_start(tl.program_id(axis=0), BLOCK_SIZE, INT64) + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    tl.store(y_ptr + offsets, gelu_math(x, APPROXIMATE).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gelu_rows_kernel(x_ptr, y_ptr, n_cols, x_row_stride, y_row_stride, BLOCK_SIZE: tl.constexpr,
                     APPROXIMATE: tl.constexpr):
    """GELU of rows one ``x_row_stride`` apart (a sliced or broadcast x): grid (rows, column tiles)."""
    row = tl.program_id(axis=0).to(tl.int64)
    cols = tl.program_id(axis=1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask).to(tl.float32)
    tl.store(y_ptr + row * y_row_stride + cols, gelu_math(x, APPROXIMATE).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def bias_gelu_scale_tuned_kernel(x_ptr, bias_ptr, y_ptr, n_elements, n_cols, scale, BLOCK_SIZE: tl.constexpr,
                                 APPROXIMATE: tl.constexpr, INT64: tl.constexpr, WRAPS: tl.constexpr):
    start = tile_start(tl.program_id(axis=0), BLOCK_SIZE, INT64)
    offsets = start + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    b = tl.load(bias_ptr + bias_columns(start, n_cols, BLOCK_SIZE, WRAPS), mask=mask).to(tl.float32)
    y = gelu_math(x + b, APPROXIMATE) * tl.cast(scale, tl.float32)  # fp64 from torch.compile: math in float32
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["seed"])
def bias_gelu_dropout_tuned_kernel(x_ptr, bias_ptr, y_ptr, n_elements, n_cols, p, keep_scale, seed,
                                   BLOCK_SIZE: tl.constexpr, APPROXIMATE: tl.constexpr, INT64: tl.constexpr,
                                   WRAPS: tl.constexpr):
    start = tile_start(tl.program_id(axis=0), BLOCK_SIZE, INT64)
    offsets = start + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    b = tl.load(bias_ptr + bias_columns(start, n_cols, BLOCK_SIZE, WRAPS), mask=mask).to(tl.float32)
    y = gelu_math(x + b, APPROXIMATE)
    r = tl.rand(seed, offsets)            # the teaching kernel's numbers: Philox of (seed, index)
    y = tl.where(r >= tl.cast(p, tl.float32), y * tl.cast(keep_scale, tl.float32), 0.0)  # fp64 from torch.compile
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Input checks: the full check once per (dtype, device), then only what can change per call
# ----------------------------------------------------------------------------------------------

# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------

def add(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x + y`` for two tensors of the same shape and dtype, in one Triton kernel."""
    _check_tensor("x", x)
    _same("y", y, x, x.shape, "match x (same shape, dtype and device)")
    out = _output(x, out)
    if x.numel() > 0:  # empty in, empty out, no launch
        cfg = config_for(x, x.dtype)
        add_tuned_kernel[cfg.grid](x, y, out, x.numel(), BLOCK_SIZE=cfg.BLOCK_SIZE, INT64=cfg.int64,
                                   num_warps=cfg.num_warps)
    return out


def gelu(x: torch.Tensor, approximate: str = "tanh", out: torch.Tensor | None = None) -> torch.Tensor:
    """GELU of ``x`` in one kernel: ``approximate='tanh'`` (the tanh approximation) or ``'none'`` (erf).

    Any layout: an x dense in memory (transposed, permuted) is walked in memory order, the output
    with its strides; rows one stride apart (``x[:, :k]``) run :func:`gelu_rows_kernel`; any other
    layout (``x[:, ::2]``) is copied once first (``x.contiguous()``: one more read and write)."""
    flag = _approximate_flag(approximate)
    _check_tensor("x", x, any_layout=True)
    dense = dense_in_memory(x)
    rows = None if dense else rows_of(x)
    if not dense and (rows is None or triton.cdiv(rows[1], 1024) > 65535):
        x, rows = x.contiguous(), None  # the one copy
    out = _output(x, out)
    if x.numel() > 0 and rows is not None:
        n_rows, n_cols, row_stride = rows
        block = min(1024, triton.next_power_of_2(n_cols))
        gelu_rows_kernel[(n_rows, triton.cdiv(n_cols, block))](x, out, n_cols, row_stride, n_cols, BLOCK_SIZE=block,
                                                               APPROXIMATE=flag, num_warps=4)
    elif x.numel() > 0:
        cfg = config_for(x, x.dtype)
        gelu_tuned_kernel[cfg.grid](x, out, x.numel(), BLOCK_SIZE=cfg.BLOCK_SIZE, APPROXIMATE=flag,
                                    INT64=cfg.int64, num_warps=cfg.num_warps)
    return out


def bias_gelu_scale(x: torch.Tensor, bias: torch.Tensor, scale: float, approximate: str = "tanh",
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """``gelu(x + bias) * scale`` in one kernel; ``bias`` has one value per column (x.shape[-1]).

    A dense, non-contiguous x (transposed, permuted, channels-last) is read in place by the teaching
    shelf's ``bias_gelu_strided_kernel`` and the output has x's strides; a slice with gaps is copied
    once (one more read and write) and the output is contiguous."""
    flag = _approximate_flag(approximate)
    x = _flat("x", x)
    n_cols = _check_bias(x, bias)
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number, got {scale}")
    out = _output(x, out)
    if x.numel() > 0 and not x.is_contiguous():
        bias_gelu_strided(x, bias, out, scale, 0.0, approximate=flag)
    elif x.numel() > 0:
        grid, meta = _bias_gelu_scale_plan(x, n_cols, flag)
        bias_gelu_scale_tuned_kernel[grid](x, bias, out, x.numel(), n_cols, scale, **meta)
    return out


def _bias_gelu_scale_plan(x: torch.Tensor, n_cols: int, flag: bool):
    """(grid, constexprs and options) of ``bias_gelu_scale_tuned_kernel`` on a contiguous x."""
    cfg = config_for(x, x.dtype)
    return cfg.grid, dict(BLOCK_SIZE=cfg.BLOCK_SIZE, APPROXIMATE=flag, INT64=cfg.int64,
                          WRAPS=bias_wraps(cfg.BLOCK_SIZE, n_cols), num_warps=cfg.num_warps)


_HOT_PLANS: dict = {}   # bias_gelu_scale_hot: (shape, strides, dtypes, devices) -> (grid, meta), checked once


def bias_gelu_scale_hot(x: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`bias_gelu_scale` (approximate="tanh") for a hot path: the first call of a (shape, strides, dtypes,
    devices) key is :func:`bias_gelu_scale`, every check included; a later one (or torch.compile's trace) launches
    through the ops' cheaper launch (:mod:`.launch`) with the grid and constexprs that first call used."""
    key = (x.shape, x.stride(), x.dtype, x.device, bias.shape, bias.stride(), bias.dtype, bias.device)
    plan = _HOT_PLANS.get(key)
    if plan is None and traced(x) and x.is_contiguous():
        plan = _bias_gelu_scale_plan(x, bias.shape[0], True)
    if plan is None or not math.isfinite(scale):
        out = bias_gelu_scale(x, bias, scale)
        if x.numel() > 0 and x.is_contiguous():
            _HOT_PLANS.clear() if len(_HOT_PLANS) >= 4096 else None   # many layouts (a sweep): start over
            _HOT_PLANS[key] = _bias_gelu_scale_plan(x, bias.shape[0], True)
        return out
    grid, meta = plan
    out = torch.empty_like(x)
    launch(bias_gelu_scale_tuned_kernel, "bias_gelu_scale", grid, (x, bias, out, x.numel(), bias.shape[0],
                                                                     float(scale)), meta)
    return out


def bias_gelu_dropout(x: torch.Tensor, bias: torch.Tensor, p: float, seed: int, approximate: str = "tanh",
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """``dropout(gelu(x + bias), p)`` in one kernel, the mask drawn in the kernel from ``seed``.

    Element i is kept when Philox(seed, i) >= p and then scaled by 1 / (1 - p): the same seed gives
    the same mask on any GPU and under the interpreter, whatever BLOCK_SIZE is. Use a new seed for
    every call, layer and training step. i is the logical flat index: a dense, non-contiguous x (read
    in place, the output in its strides, as :func:`bias_gelu_scale` does) gets x.contiguous()'s mask.
    """
    flag = _approximate_flag(approximate)
    p, seed = dropout_args(p, seed)
    x = _flat("x", x)
    n_cols = _check_bias(x, bias)
    out = _output(x, out)
    if x.numel() > 0 and not x.is_contiguous():
        bias_gelu_strided(x, bias, out, 1.0, p, seed, approximate=flag)
    elif x.numel() > 0:
        cfg = config_for(x, x.dtype, DROPOUT_MAX_BLOCK)
        bias_gelu_dropout_tuned_kernel[cfg.grid](x, bias, out, x.numel(), n_cols, p, 1.0 / (1.0 - p), seed,
                                                 BLOCK_SIZE=cfg.BLOCK_SIZE, APPROXIMATE=flag, INT64=cfg.int64,
                                                 WRAPS=bias_wraps(cfg.BLOCK_SIZE, n_cols), num_warps=cfg.num_warps)
    return out


def dropout_keep_mask(shape, p: float, seed: int, device=None) -> torch.Tensor:
    """The boolean keep mask :func:`bias_gelu_dropout` uses for ``shape``, ``p`` and ``seed``.

    The teaching shelf's ``keep_mask_kernel``, launched with the tiles of a float32 dropout (the mask
    depends on no tile). Its offsets are int64; Philox draws the same numbers from them as from the
    int32 offsets of :func:`bias_gelu_dropout_tuned_kernel` (the offset's high word is 0 below 2^32)."""
    p, seed = dropout_args(p, seed)
    keep = torch.empty(tuple(shape), dtype=torch.int8, device=torch.device(device) if device else env.DEVICE)
    if keep.numel() > 0:
        cfg = config_for(keep, torch.float32, DROPOUT_MAX_BLOCK)
        keep_mask_kernel[cfg.grid](keep, keep.numel(), p, seed, BLOCK_SIZE=cfg.BLOCK_SIZE, num_warps=cfg.num_warps)
    return keep.bool()


def compile_cases(info):
    """The launches the compile matrix compiles for ``info`` (see course_utils/aot.py): both shelves,
    every dtype, a small and a large tile, rows shorter than a tile (WRAPS), and int64 offsets."""
    from ..aot import dtype_name, dtypes_for, empty
    from ..kernels import elementwise as teaching

    for dt in dtypes_for(info):
        for shape in ((1000,), (4096, 4096)):  # a small tile for a small tensor, the full tile for a large one
            tag, b = f"{dtype_name(dt)} {'x'.join(map(str, shape))}", shape[-1]
            yield f"add {tag}", lambda s=shape, dt=dt: add(empty(*s, dtype=dt), empty(*s, dtype=dt))
            for a in ("tanh", "none"):
                yield f"gelu {a} {tag}", lambda s=shape, dt=dt, a=a: gelu(empty(*s, dtype=dt), a)
                yield (f"bias_gelu_scale {a} {tag}", lambda s=shape, b=b, dt=dt, a=a:
                       bias_gelu_scale(empty(*s, dtype=dt), empty(b, dtype=dt), 0.5, a))
                yield (f"bias_gelu_dropout {a} {tag}", lambda s=shape, b=b, dt=dt, a=a:
                       bias_gelu_dropout(empty(*s, dtype=dt), empty(b, dtype=dt), 0.1, 1234, a))
        x, b = (lambda dt=dt: empty(333, 1001, dtype=dt)), (lambda dt=dt: empty(1001, dtype=dt))
        yield f"add_teaching {dtype_name(dt)}", lambda x=x: teaching.add_teaching(x(), x())
        yield f"gelu_teaching {dtype_name(dt)}", lambda x=x: teaching.gelu_teaching(x())
        yield f"bias_gelu_scale_teaching {dtype_name(dt)}", lambda x=x, b=b: teaching.bias_gelu_scale_teaching(
            x(), b(), 0.5)
        yield f"bias_gelu_dropout_teaching {dtype_name(dt)}", lambda x=x, b=b: teaching.bias_gelu_dropout_teaching(
            x(), b(), 0.1, 7)
    yield "dropout_keep_mask_teaching", lambda: teaching.dropout_keep_mask_teaching((333, 1001), 0.1, 7)
    yield "dropout_keep_mask", lambda: dropout_keep_mask((4096, 4096), 0.1, 1234)
    yield "gelu strided rows", lambda: gelu(empty(4096, 8192, dtype=torch.float16)[:, :4100])
    narrow = (4096, 100)  # rows shorter than a tile: the bias columns wrap several times per tile (ANY_WRAP)
    yield "bias_gelu_scale narrow rows", lambda: bias_gelu_scale(empty(*narrow), empty(100), 0.5)
    yield "bias_gelu_dropout narrow rows", lambda: bias_gelu_dropout(empty(*narrow), empty(100), 0.1, 7)
    big, h = (2**21, 1024), torch.float16  # 2^31 elements: int64 offsets (nothing is allocated)
    yield "add int64", lambda: add(empty(*big, dtype=h), empty(*big, dtype=h))
    yield "gelu int64", lambda: gelu(empty(*big, dtype=h))
    yield "bias_gelu_scale int64", lambda: bias_gelu_scale(empty(*big, dtype=h), empty(1024, dtype=h), 0.5)
    yield "bias_gelu_dropout int64", lambda: bias_gelu_dropout(empty(*big, dtype=h), empty(1024, dtype=h), 0.1, 7)
    yield "dropout_keep_mask int64", lambda: dropout_keep_mask(big, 0.1, 7)
    yield "gelu_teaching 2^31", lambda: teaching.gelu_teaching(empty(*big, dtype=h))
