"""``course::linear_gelu(x, weight, bias) = gelu_tanh(x @ weight.T + bias)``, ``weight`` laid out as
``nn.Linear``'s (out, in), ``x`` of any leading dims. Two plans, the faster kept per shape:

- ``"cublas"``: cuBLAS's matmul writes ``acc = x @ weight.T``, chapter 4's bias + GELU kernel reads it
  and writes y; ``acc`` is saved, and the backward's one kernel (chapter 11) reads dy and acc and
  writes dacc and the bias gradient; cuBLAS computes dx and dW. Both kernels are launched through the
  ops' cheaper launch (``bias_gelu_scale_hot``, :mod:`course_utils.tuned.gelu_backward`).
- ``"gemm"``: chapter 9's GEMM with bias + GELU in its epilogue (y only, one kernel); the backward
  recomputes ``acc`` with the same GEMM (z is never stored), then the same bias + GELU backward and
  two more GEMMs of the course.

On a GPU both are timed once per (shape, dtype, device), forward and backward together, and the
faster is kept in ``PLANS`` (:func:`course_utils.ops.warmup` or the first call makes the choice);
under the interpreter, or while ``torch.compile`` traces an unknown shape, ``"cublas"``.
:func:`linear_plan` forces one. Under CUDA autocast the inputs are cast as ``F.linear``'s would be.
"""

from __future__ import annotations

import contextlib

import torch

from .. import env, hardware
from ..kernels.gemm import check_operands
from ..state import RuntimeCache
from ..tuned import choice
from ..tuned import elementwise as EW
from ..tuned import gelu_backward as GB
from ..tuned import gemm as G
from . import _lib

PLANS: dict = RuntimeCache()
LINEAR_PLANS = ("cublas", "gemm")
_FORCED: list = []


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, gelu: bool = False) -> torch.Tensor:
    """``gelu?(a @ b + bias?)`` by the tuned GEMM with a cached tile plan (a, b 2-D, any strides). The
    operands are checked on the first call of a (shapes, strides, dtypes, devices) key only."""
    key = (a.shape, b.shape, a.stride(), b.stride(), a.dtype, b.dtype, a.device, b.device, gelu,
           None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.device))
    cfg = PLANS.get(key)
    M, N, K = check_operands(a, b, bias) if cfg is None else (a.shape[0], b.shape[1], a.shape[1])
    c = torch.empty((M, N), dtype=a.dtype, device=a.device)
    if M == 0 or N == 0:
        return c
    if K == 0:
        c.zero_()
        if bias is not None:
            c += bias
        return torch.nn.functional.gelu(c, approximate="tanh") if gelu else c
    if cfg is None:
        tma_ok = G._tma_layout(a) is not None and G._tma_layout(b) is not None
        cands = G.gemm_configs(hardware.device_info(a), M, N, K, a.dtype, tma_ok)
        if _lib.tracing(a):   # the rule's tile, not kept: a later eager call times the candidates
            cfg = cands[0]
        else:
            cfg = PLANS[key] = G._choose(cands, a, b, c, bias, M, N, K, 0.0, 0, gelu)
    G._launch(cfg, a, b, c, bias, M, N, K, 0.0, 0, gelu)
    return c


@contextlib.contextmanager
def linear_plan(plan: str):
    """Run every ``linear_gelu`` inside the block with ``plan`` (one of LINEAR_PLANS), not the timed choice."""
    if plan not in LINEAR_PLANS:
        raise ValueError(f"linear_gelu plan must be one of {LINEAR_PLANS}, got {plan!r}")
    _FORCED.append(plan)
    try:
        yield
    finally:
        _FORCED.pop()


def _check(x, weight, bias):
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear_gelu: weight must be (out_features, in_features) with in_features = "
                         f"x.shape[-1] = {x.shape[-1]}, got {tuple(getattr(weight, 'shape', ()))}")
    if not isinstance(bias, torch.Tensor) or bias.shape != weight.shape[:1]:
        raise ValueError(f"linear_gelu: bias must have out_features = {weight.shape[0]} elements, "
                         f"got {tuple(getattr(bias, 'shape', ()))}")


def _plan_key(x, weight):
    return ("linear_gelu", x.numel() // max(x.shape[-1], 1), weight.shape, x.dtype, weight.dtype, x.device)


def _plan(x, weight, bias) -> str:
    if _FORCED:
        return _FORCED[-1]
    if _lib.INDUCTOR_SEES_KERNELS and _lib.tracing(x):
        return "cublas"   # Inductor's graph: cuBLAS's GEMM and the epilogue kernel (the GEMM plan's TMA is not traced)
    key = _plan_key(x, weight)
    plan = PLANS.get(key)
    if plan is None:
        _check(x, weight, bias)
        if _lib.tracing(x):
            return "cublas"
        timed = env.on_gpu() and x.numel() > 0
        plan = PLANS[key] = _time_plans(x, weight, bias, key) if timed else "cublas"
    return plan


def _time_plans(x, weight, bias, key) -> str:
    """The faster plan, forward and backward together, timed once per key (chapter 9's table)."""
    dy = torch.randn((*x.shape[:-1], weight.shape[0]), dtype=x.dtype, device=x.device)

    def run(plan):
        y, acc = _forward(plan, x, weight, bias)
        _backward_kernels(plan, dy, x, weight, bias, acc)
    return choice.fastest(list(LINEAR_PLANS), key, run, {},
                          timer=lambda f: choice.do_bench_median(f, warmup=3, rep=10))


def _forward(plan: str, x, weight, bias):
    x2 = x.reshape(-1, x.shape[-1])
    if plan == "gemm":
        return matmul(x2, weight.t(), bias, gelu=True).view(*x.shape[:-1], weight.shape[0]), x.new_empty((0,))
    acc = torch.mm(x2, weight.t())
    y = EW.bias_gelu_scale_hot(acc, bias, 1.0)
    return y.view(*x.shape[:-1], weight.shape[0]), acc


def linear_gelu_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor):
    """``(y, acc)``: acc = x @ weight.T saved for the backward by the cuBLAS plan, empty for the GEMM plan."""
    return _forward(_plan(x, weight, bias), x, weight, bias)


def _fake_fwd(x, weight, bias):
    _check(x, weight, bias)
    y = x.new_empty((*x.shape[:-1], weight.shape[0]))
    try:   # symbolic shapes (dynamic tracing) cannot key the plans: the rule's plan
        plan = _FORCED[-1] if _FORCED else "cublas" if _lib.INDUCTOR_SEES_KERNELS else \
            PLANS.get(_plan_key(x, weight), "cublas")
    except TypeError:
        plan = "cublas"
    return y, (x.new_empty((0,)) if plan == "gemm" else x.new_empty((x.numel() // max(x.shape[-1], 1),
                                                                    weight.shape[0])))


def _backward_kernels(plan, dy, x, weight, bias, acc):
    x2 = x.reshape(-1, x.shape[-1])
    mm = torch.mm if plan == "cublas" else matmul
    if plan == "gemm":
        acc = matmul(x2, weight.t())                           # z - b, recomputed rather than stored
    # shapes star-unpacked: view/reshape parse a torch.Size argument for ~2.5 us, its ints for ~1 (CPU, measured)
    dy2 = dy.reshape(*acc.shape)
    dy2 = dy2.to(acc.dtype) if dy2.dtype != acc.dtype else dy2
    dacc, db = GB.bias_gelu_backward(dy2.contiguous(), acc, bias)
    dx = mm(dacc, weight)                                      # (M, N) @ (N, K)
    dw = mm(dacc.t(), x2)                                      # (N, M) @ (M, K)
    return dx.view(*x.shape), dw, db


def linear_gelu_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, acc: torch.Tensor):
    plan = "gemm" if acc.numel() == 0 and x.numel() and weight.numel() else "cublas"
    return _backward_kernels(plan, dy, x, weight, bias, acc)


def _fake_bwd(dy, x, weight, bias, acc):
    return (x.new_empty(x.shape), torch.empty_like(weight, memory_format=torch.contiguous_format),
            torch.empty_like(bias, memory_format=torch.contiguous_format))


def _setup(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight, bias, output[1])


def _backward(ctx, dy, _dacc=None):
    if dy is None:
        return None, None, None
    x, weight, bias, acc = ctx.saved_tensors
    return ctx.bwd(dy, x, weight, bias, acc)


FWD = _lib.kernel_op("linear_gelu_fwd", "(Tensor x, Tensor weight, Tensor bias) -> (Tensor, Tensor)",
                     linear_gelu_fwd, _fake_fwd)
BWD = _lib.kernel_op("linear_gelu_bwd", "(Tensor dy, Tensor x, Tensor weight, Tensor bias, Tensor acc) -> "
                     "(Tensor, Tensor, Tensor)", linear_gelu_bwd, _fake_bwd)
_lib.autograd(FWD, _setup, _backward, BWD)
torch.library.register_autocast("course::linear_gelu_fwd", "cuda", torch.bfloat16)
_lib.public_op("linear_gelu", "(Tensor x, Tensor weight, Tensor bias) -> Tensor",
               lambda x, w, b: torch.ops.course.linear_gelu_fwd(x, w, b)[0])
LinearGelu = _lib.fast_function("LinearGelu", linear_gelu_fwd, _setup, _backward, linear_gelu_bwd)
