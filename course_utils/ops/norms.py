"""``course::layer_norm`` (chapter 10's tuned kernels) and ``course::add_layer_norm`` (chapter 12's
residual add + LayerNorm, :mod:`course_utils.kernels.add_layernorm`), forward and backward.

Launch plans are made once per (shapes, strides, dtypes, device) and kept in ``PLANS``, with the
inputs' checks: a call whose plan is known reads one dict entry, allocates its outputs and launches
(host time is speed: chapter 12 counts it). The forward tile is a pure function of the shape; the
backward plan of ``layer_norm`` is the fastest of chapter 10's candidates, timed on the first call for
that shape (:func:`course_utils.ops.warmup` makes that call ahead of the hot path; while
``torch.compile`` traces, the first candidate). The kernels read x by its row stride when the rows
are evenly strided (no view, no copy), else from one contiguous copy. ``add_layer_norm`` writes s in
the wider dtype of x and the residual (the residual stream) and y in x's (the compute dtype).
"""

from __future__ import annotations

import torch

from .. import env, hardware
from ..kernels import add_layernorm as A
from ..state import RuntimeCache
from ..tuned import layernorm as T
from ..tuned.layernorm_kernels import norm_fwd_kernel
from . import _lib

PLANS: dict = RuntimeCache()


# --------------------------------------------------------------------------- layer_norm


def _rows_view(t: torch.Tensor, n: int):
    """(t itself, its row stride) when t's rows of n elements are evenly strided with unit column stride
    (the kernel needs a base pointer and a row stride, no view), else None."""
    if t.dim() == 0 or (t.stride(-1) != 1 and n > 1):
        return None
    stride = t.stride(-2) if t.dim() > 1 else n
    expect = stride
    for size, st in zip(reversed(t.shape[:-1]), reversed(t.stride()[:-1])):
        if size != 1 and st != expect:
            return None
        expect = st * size if size != 1 else expect
    return stride


def _ln_fwd_plan(x, weight, bias):
    """Checked once per (shape, strides, dtypes, device), with all a call needs besides its tensors: the size and
    strides of mean and rstd (x's leading dims), the launch's grid and meta-parameters, the rows, the width and x's
    row stride (None: not evenly strided)."""
    key = ("ln_fwd", x.shape, x.stride(), x.dtype, weight.dtype, bias.dtype, x.device)
    plan = PLANS.get(key)
    if plan is None:
        n = A.check("layer_norm", x, weight, ("bias", bias, weight.shape), max_cols=T.MAX_BLOCK_N)
        n_rows = x.numel() // n if n else 0
        p = T.plan_forward(max(n_rows, 1), n, x.element_size(), hardware.device_info(x))
        stats = tuple(x.shape[:-1])
        meta = dict(BLOCK_N=p.BLOCK_N, ROWS=p.ROWS, RMS=False, HAS_BIAS=True, STATS=True, num_warps=p.num_warps)
        plan = PLANS[key] = (stats, _lib.contiguous_strides(stats), (p.grid,), meta, n_rows, n, _rows_view(x, n))
    return plan


def layer_norm_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float):
    stats, strides, grid, meta, n_rows, n, stride = _ln_fwd_plan(x, weight, bias)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)   # the cheap allocations: _lib says why
    mean = torch.empty_strided(stats, strides, dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    if n_rows:
        if stride is None:   # rows that are not evenly strided: one copy
            x, stride = A.rows_of(x, n), n
        _lib.launch(norm_fwd_kernel, "ln_fwd", grid, (y, x, weight, bias, mean, rstd, n_rows, n, stride, n, eps), meta)
    return y, mean, rstd


def _fake_fwd(x, weight, bias, eps):
    stats = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return torch.empty_like(x, memory_format=torch.contiguous_format), stats, torch.empty_like(stats)


def _ln_bwd_plan(dy, x, weight, mean, rstd):
    """Checked once per (shapes, strides, dtypes, device): the chosen plan's launch (timed on the first call,
    chapter 10's candidates) and the row strides of x and dy (None: not evenly strided, copied per call).
    While torch.compile traces, or with deterministic algorithms on, the first candidate, not kept."""
    key = ("ln_bwd", x.shape, x.stride(), dy.shape, dy.stride(), x.dtype, dy.dtype, weight.dtype, x.device)
    plan = PLANS.get(key)
    if plan is not None:
        return plan
    n = A.check("layer_norm backward", x, weight, ("dy", dy, x.shape), max_cols=T.MAX_BLOCK_N)
    n_rows = x.numel() // n if n else 0
    cands = T.backward_candidates(max(n_rows, 1), n, x.element_size(), hardware.device_info(x))
    fixed = torch.are_deterministic_algorithms_enabled() or _lib.tracing(x) or n_rows == 0
    if not fixed:
        x2, dy2 = A.rows_of(x, n), A.rows_of(dy, n)
        dx2 = x.new_empty((n_rows, n))
        cands = [T._choose(cands, key, lambda p: T._finish_backward(p, dx2, dy2, x2, weight, mean, rstd, False,
                                                                     False))]
    plan = (T.backward_launch(cands[0], n, rms=False), n, n_rows, _rows_view(x, n), _rows_view(dy, n))
    if not fixed:
        PLANS[key] = plan
    return plan


def layer_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor,
                   rstd: torch.Tensor):
    if T._PINNED is not None:   # a plan pinned by tuned.layernorm.backward_plan() (a check timing one)
        return _ln_bwd_pinned(dy, x, weight, mean, rstd)
    launch, n, n_rows, xs, dys = _ln_bwd_plan(dy, x, weight, mean, rstd)
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    if n_rows == 0:
        return dx, torch.zeros_like(weight), torch.zeros_like(weight)
    if xs is None:
        x, xs = A.rows_of(x, n), n
    if dys is None:
        dy, dys = A.rows_of(dy, n), n
    dw, db = T.launch_backward(launch, dx, dy, x, weight, mean, rstd, n_rows, n, xs, dys)
    return (dx, *T.column_sum_pair(dw, db, weight.dtype))


def _ln_bwd_pinned(dy, x, weight, mean, rstd):
    A.check("layer_norm backward", x, weight, ("dy", dy, x.shape), max_cols=T.MAX_BLOCK_N)
    n = x.shape[-1]
    x2, dy2 = A.rows_of(x, n), A.rows_of(dy, n)
    dx = x.new_empty(x.shape)
    if x.numel() == 0:
        return dx, torch.zeros_like(weight), torch.zeros_like(weight)
    _, dw, db = T._finish_backward(T._PINNED, dx.view(x2.shape), dy2, x2, weight, mean, rstd, False, False)
    return dx, dw, db


def _fake_bwd(dy, x, weight, mean, rstd):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight), \
        torch.empty_like(weight)


def _ln_setup(ctx, inputs, output):
    x, weight, _, _ = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)


def _ln_backward(ctx, dy, _dmean=None, _drstd=None):
    if dy is None:
        return None, None, None, None
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = ctx.bwd(dy, x, weight, mean, rstd)
    return dx, dw, db, None


LN_FWD = _lib.kernel_op("layer_norm_fwd", "(Tensor x, Tensor weight, Tensor bias, float eps) -> "
                        "(Tensor, Tensor, Tensor)", layer_norm_fwd, _fake_fwd)
LN_BWD = _lib.kernel_op("layer_norm_bwd", "(Tensor dy, Tensor x, Tensor weight, Tensor mean, Tensor rstd) -> "
                        "(Tensor, Tensor, Tensor)", layer_norm_bwd, _fake_bwd)
_lib.autograd(LN_FWD, _ln_setup, _ln_backward, LN_BWD)
_lib.public_op("layer_norm", "(Tensor x, Tensor weight, Tensor bias, float eps) -> Tensor",
               lambda x, w, b, eps: torch.ops.course.layer_norm_fwd(x, w, b, eps)[0])
LayerNorm = _lib.fast_function("LayerNorm", layer_norm_fwd, _ln_setup, _ln_backward, layer_norm_bwd)


# --------------------------------------------------------------------------- add_layer_norm


def _aln_fwd_plan(x, residual, weight, bias):
    """Checked once per (shapes, strides, dtypes, device): tile, grid, the inputs' row strides."""
    key = ("aln_fwd", x.shape, x.stride(), residual.stride(), x.dtype, residual.dtype, weight.dtype, bias.dtype,
           x.device)
    plan = PLANS.get(key)
    if plan is None:
        n = A.check("add_layer_norm", x, weight, ("residual", residual, x.shape), ("bias", bias, weight.shape))
        n_rows = x.numel() // n if n else 0
        block = _lib.next_pow2(n)
        rows = max(1, min(A.TILE_ELEMENTS // block, _lib.next_pow2(n_rows)))
        stats = tuple(x.shape[:-1])
        plan = PLANS[key] = dict(n=n, n_rows=n_rows, block=block, rows=rows, grid=_lib.cdiv(max(n_rows, 1), rows),
                                 num_warps=max(4, min(16, rows * block // 512)),
                                 x_stride=_rows_view(x, n), r_stride=_rows_view(residual, n),
                                 s_dtype=torch.promote_types(x.dtype, residual.dtype), shape=tuple(x.shape),
                                 strides=_lib.contiguous_strides(x.shape), stats=stats,
                                 stats_strides=_lib.contiguous_strides(stats))
    return plan


def add_layer_norm_fwd(x, residual, weight, bias, eps: float):
    """``(y, s, mean, rstd)``: s = x + residual in the wider dtype of the two (the residual stream), y =
    LayerNorm(s) in x's dtype (the compute dtype of the branch: under bf16 nothing casts it down again)."""
    p = _aln_fwd_plan(x, residual, weight, bias)
    s = torch.empty_strided(p["shape"], p["strides"], dtype=p["s_dtype"], device=x.device)   # _lib: why not new_empty
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    mean = torch.empty_strided(p["stats"], p["stats_strides"], dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    n, n_rows = p["n"], p["n_rows"]
    if n_rows:
        xs, rs = p["x_stride"], p["r_stride"]
        if xs is None:
            x, xs = A.rows_of(x, n), n
        if rs is None:
            residual, rs = A.rows_of(residual, n), n
        _lib.launch(A.add_layer_norm_fwd_kernel, "aln_fwd", (p["grid"],),
                    (s, y, x, residual, weight, bias, mean, rstd, n_rows, n, xs, rs, eps),
                    dict(BLOCK_N=p["block"], ROWS=p["rows"], num_warps=p["num_warps"]))
    return y, s, mean, rstd



def _fake_aln_fwd(x, residual, weight, bias, eps):
    s = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype))
    stats = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return x.new_empty(x.shape), s, stats, torch.empty_like(stats)


def _aln_bwd_plan(dy, ds, s, weight):
    key = ("aln_bwd", s.shape, dy.stride(), None if ds is None else ds.stride(), dy.dtype,
           None if ds is None else ds.dtype, s.dtype, weight.dtype, s.device)
    plan = PLANS.get(key)
    if plan is None:
        n = A.check("add_layer_norm backward", s, weight, ("dy", dy, s.shape), ("ds", ds, s.shape))
        n_rows = s.numel() // n if n else 0
        block = _lib.next_pow2(n)
        rows = max(1, min(A.TILE_ELEMENTS // block, _lib.next_pow2(n_rows)))
        info = hardware.device_info(s) if env.on_gpu() else None
        programs = info.sms * 2 if info else 4
        per_program = _lib.cdiv(_lib.cdiv(max(n_rows, 1), programs), rows) * rows
        # s, dy and ds tiles in flight (T.loop_stages): on an H200 at 768 columns, 3 stages and 4 warps ran the
        # GPT-2 step's call 3.1x faster than the loop as written with 8 warps (114 -> 37 us at 16384 rows)
        loaded = s.element_size() + dy.element_size() + (0 if ds is None else ds.element_size())
        stages = T.loop_stages(rows * block, loaded, info) if info else 0
        plan = PLANS[key] = dict(n=n, n_rows=n_rows, block=block, rows=rows, per_program=per_program,
                                 grid=_lib.cdiv(max(n_rows, 1), per_program), stages=stages or None,
                                 num_warps=max(4, min(16, rows * block // (1024 if stages else 512))),
                                 dy_stride=_rows_view(dy, n), ds_stride=None if ds is None else _rows_view(ds, n))
    return plan


def add_layer_norm_bwd(dy, ds, s, weight, mean, rstd):
    """``(dx, dw, db)``: dx = ds + dLayerNorm(dy) in s's dtype (both inputs of the add get it)."""
    dx, _, dw, db = _aln_bwd(dy, ds, s, weight, mean, rstd, None)
    return dx, dw, db


def add_layer_norm_bwd_low(dy, ds, s, weight, mean, rstd, low_dtype: torch.dtype):
    """``(dx, dx_low, dw, db)``: :func:`add_layer_norm_bwd` with dx also in ``low_dtype`` (the branch's compute
    dtype, where the stream s is wider), stored by the same kernel from the same registers: no cast kernel reads
    dx back. ``dx_low`` is dx itself when ``low_dtype`` is s's dtype."""
    if low_dtype == s.dtype:
        dx, dw, db = add_layer_norm_bwd(dy, ds, s, weight, mean, rstd)
        return dx, dx, dw, db
    return _aln_bwd(dy, ds, s, weight, mean, rstd, low_dtype)


def _aln_bwd(dy, ds, s, weight, mean, rstd, low_dtype):
    p = _aln_bwd_plan(dy, ds, s, weight)
    n, n_rows = p["n"], p["n_rows"]
    dx = torch.empty_like(s, memory_format=torch.contiguous_format)
    dx_low = dx if low_dtype is None else torch.empty_like(dx, dtype=low_dtype)
    if n_rows == 0:
        return dx, dx_low, torch.zeros_like(weight), torch.zeros_like(weight)
    dys, dss = p["dy_stride"], p["ds_stride"]
    if dys is None:
        dy, dys = A.rows_of(dy, n), n
    if ds is not None and dss is None:
        ds, dss = A.rows_of(ds, n), n
    dw = torch.empty_strided((p["grid"], n), (n, 1), dtype=torch.float32, device=s.device)
    db = torch.empty_like(dw)
    _lib.launch(A.add_layer_norm_bwd_kernel, "aln_bwd", (p["grid"],),
                (dx, dx_low, dy, dy if ds is None else ds, s, weight, mean, rstd, dw, db, n_rows, n, dys,
                 dys if ds is None else dss, p["per_program"]),
                dict(BLOCK_N=p["block"], ROWS=p["rows"], HAS_DS=ds is not None, STAGES=p["stages"],
                     LOW=low_dtype is not None, num_warps=p["num_warps"]))
    return (dx, dx_low, *T.column_sum_pair(dw, db, weight.dtype))


def _fake_aln_bwd(dy, ds, s, weight, mean, rstd):
    return torch.empty_like(s, memory_format=torch.contiguous_format), torch.empty_like(weight), \
        torch.empty_like(weight)


def _aln_setup(ctx, inputs, output):
    x, residual, weight, _, _ = inputs
    _, s, mean, rstd = output
    ctx.save_for_backward(s, weight, mean, rstd)
    ctx.dtypes = (x.dtype, residual.dtype)


def _aln_backward(ctx, dy, ds, _dmean=None, _drstd=None):
    s, weight, mean, rstd = ctx.saved_tensors
    if dy is None and ds is None:
        return None, None, None, None, None
    if dy is None:
        dy = torch.zeros_like(s)
    xd, rd = ctx.dtypes
    low = xd if xd != s.dtype else rd if rd != s.dtype else None   # an input narrower than the stream s
    if low is not None and ctx.bwd is add_layer_norm_bwd:
        # the eager fast path's own function (not the registered op, whose graph Inductor fuses the cast into):
        # its kernel writes dx in both dtypes
        dx, dx_low, dw, db = _aln_bwd(dy, ds, s, weight, mean, rstd, low)
    else:
        dx, dw, db = ctx.bwd(dy, ds, s, weight, mean, rstd)
        dx_low = None
    dx_in, dr_in = (dx if t == dx.dtype else dx_low if dx_low is not None and t == dx_low.dtype else dx.to(t)
                    for t in ctx.dtypes)
    return dx_in, dr_in, dw, db, None


ALN_FWD = _lib.kernel_op("add_layer_norm_fwd", "(Tensor x, Tensor residual, Tensor weight, Tensor bias, float eps) -> "
                         "(Tensor, Tensor, Tensor, Tensor)", add_layer_norm_fwd, _fake_aln_fwd)
ALN_BWD = _lib.kernel_op("add_layer_norm_bwd", "(Tensor dy, Tensor? ds, Tensor s, Tensor weight, Tensor mean, "
                         "Tensor rstd) -> (Tensor, Tensor, Tensor)", add_layer_norm_bwd, _fake_aln_bwd)
_lib.autograd(ALN_FWD, _aln_setup, _aln_backward, ALN_BWD)
_lib.public_op("add_layer_norm", "(Tensor x, Tensor residual, Tensor weight, Tensor bias, float eps) -> "
               "(Tensor, Tensor)",
               lambda x, r, w, b, eps: tuple(torch.ops.course.add_layer_norm_fwd(x, r, w, b, eps)[:2]))
AddLayerNorm = _lib.fast_function("AddLayerNorm", add_layer_norm_fwd, _aln_setup, _aln_backward, add_layer_norm_bwd,
                                  public=2)
