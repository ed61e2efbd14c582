"""``course::layer_norm`` (chapter 10's tuned kernels) and ``course::add_layer_norm`` (chapter 12's
residual add + LayerNorm, :mod:`course_utils.kernels.add_layernorm`), forward and backward.

Launch plans are chosen once per (rows, columns, dtype, device) and kept in ``PLANS``: the forward
tile is a pure function of the shape; the backward plan of ``layer_norm`` is the fastest of chapter
10's candidates, timed on the first call for that shape (:func:`course_utils.ops.warmup` makes that
call ahead of the hot path). Nothing global is written on a call whose plan is known.
"""

from __future__ import annotations

import torch
import triton

from .. import env, hardware
from ..kernels import add_layernorm as A
from ..tuned import layernorm as T
from ..tuned.layernorm_kernels import norm_fwd_kernel
from . import _lib

PLANS: dict = {}


def _key(what: str, x: torch.Tensor, n: int, *extra):
    return (what, x.numel() // n if n else 0, n, x.dtype, x.device, *extra)


# --------------------------------------------------------------------------- layer_norm


def _ln_fwd_plan(n_rows: int, n: int, x: torch.Tensor) -> T.Plan:
    key = _key("ln_fwd", x, n)
    plan = PLANS.get(key)
    if plan is None:
        plan = PLANS[key] = T.plan_forward(n_rows, n, x.element_size(), hardware.device_info(x))
    return plan


def layer_norm_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float):
    n = A.check("layer_norm", x, weight, ("bias", bias, weight.shape), max_cols=T.MAX_BLOCK_N)
    x2 = A.rows_of(x, n)
    n_rows = x2.shape[0]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    mean = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    if x.numel():
        p = _ln_fwd_plan(n_rows, n, x)
        norm_fwd_kernel[(p.grid,)](y, x2, weight, bias, mean, rstd, n_rows, n, x2.stride(0), n, eps,
                                   BLOCK_N=p.BLOCK_N, ROWS=p.ROWS, RMS=False, HAS_BIAS=True, STATS=True,
                                   num_warps=p.num_warps)
    return y, mean, rstd


def _fake_fwd(x, weight, bias, eps):
    stats = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return torch.empty_like(x, memory_format=torch.contiguous_format), stats, torch.empty_like(stats)


def layer_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor,
                   rstd: torch.Tensor):
    n = A.check("layer_norm backward", x, weight, ("dy", dy, x.shape), max_cols=T.MAX_BLOCK_N)
    x2, dy2 = A.rows_of(x, n), A.rows_of(dy, n)
    n_rows = x2.shape[0]
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return dx, torch.zeros_like(weight), torch.zeros_like(weight)
    key = _key("ln_bwd", x, n, dy.dtype)
    dx2 = dx.view(n_rows, n)
    plan = T._PINNED or PLANS.get(key)   # a plan pinned by tuned.layernorm.backward_plan() wins
    if plan is None:
        cands = T.backward_candidates(n_rows, n, x.element_size(), hardware.device_info(x))
        if torch.are_deterministic_algorithms_enabled():
            plan = cands[0]   # as chapter 10's launcher: no timed choice, so no run-to-run plan change
        else:
            plan = PLANS[key] = T._choose(cands, key, lambda p: T._finish_backward(p, dx2, dy2, x2, weight, mean,
                                                                                   rstd, False, False))
    _, dw, db = T._finish_backward(plan, dx2, dy2, x2, weight, mean, rstd, False, False)
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


def _aln_plan(x: torch.Tensor, n: int, what: str) -> dict:
    key = _key(what, x, n)
    plan = PLANS.get(key)
    if plan is None:
        n_rows, block = x.numel() // n, triton.next_power_of_2(n)
        rows = max(1, min(A.TILE_ELEMENTS // block, triton.next_power_of_2(n_rows)))
        plan = {"rows": rows, "num_warps": max(4, min(16, rows * block // 512))}
        if what == "aln_bwd":
            plan["programs"] = hardware.device_info(x).sms * 2 if env.on_gpu() else 4
        PLANS[key] = plan
    return plan


def add_layer_norm_fwd(x, residual, weight, bias, eps: float):
    n = x.shape[-1] if x.dim() else 1
    return A.add_layer_norm_teaching(x, residual, weight, bias, eps, **_aln_plan(x, max(n, 1), "aln_fwd"))


def _fake_aln_fwd(x, residual, weight, bias, eps):
    dtype = torch.promote_types(x.dtype, residual.dtype)
    y = x.new_empty(x.shape, dtype=dtype)
    stats = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return y, torch.empty_like(y), stats, torch.empty_like(stats)


def add_layer_norm_bwd(dy, ds, s, weight, mean, rstd):
    n = s.shape[-1] if s.dim() else 1
    return A.add_layer_norm_backward_teaching(dy, ds, s, weight, mean, rstd, **_aln_plan(s, max(n, 1), "aln_bwd"))


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
    dx, dw, db = ctx.bwd(dy, ds, s, weight, mean, rstd)
    dx_in, dr_in = (dx if dx.dtype == t else dx.to(t) for t in ctx.dtypes)
    return dx_in, dr_in, dw, db, None


ALN_FWD = _lib.kernel_op("add_layer_norm_fwd", "(Tensor x, Tensor residual, Tensor weight, Tensor bias, float eps) -> "
                         "(Tensor, Tensor, Tensor, Tensor)", add_layer_norm_fwd, _fake_aln_fwd)
ALN_BWD = _lib.kernel_op("add_layer_norm_bwd", "(Tensor dy, Tensor? ds, Tensor s, Tensor weight, Tensor mean, "
                         "Tensor rstd) -> (Tensor, Tensor, Tensor)", add_layer_norm_bwd, _fake_aln_bwd)
_lib.autograd(ALN_FWD, _aln_setup, _aln_backward, ALN_BWD)
_lib.public_op("add_layer_norm", "(Tensor x, Tensor residual, Tensor weight, Tensor bias, float eps) -> "
               "(Tensor, Tensor)",
               lambda x, r, w, b, eps: tuple(torch.ops.course.add_layer_norm_fwd(x, r, w, b, eps)[:2]))
AddLayerNorm = _lib.fast_function("AddLayerNorm", add_layer_norm_fwd, _aln_setup, _aln_backward, add_layer_norm_bwd)
