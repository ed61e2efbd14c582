"""``course::linear_gelu(x, weight, bias) = gelu_tanh(x @ weight.T + bias)``: chapter 9's GEMM with the
bias + GELU epilogue (:mod:`course_utils.tuned.gemm`) forward; backward as :mod:`course_utils.autograd.gemm`
does it: ``z`` recomputed by the same GEMM, chapter 11's bias + GELU backward kernel for dz and db,
then two more GEMMs of the course for dx and dW. ``weight`` is laid out as ``nn.Linear``'s (out, in);
``x`` has any leading dims. Under CUDA autocast the inputs are cast to the autocast dtype, as
``F.linear`` would be.

Tile plans are kept per (shape, dtype, strides, device) in ``PLANS`` (timed on the first call of a
shape on the GPU: :func:`course_utils.ops.warmup` makes that call).
"""

from __future__ import annotations

import torch
import triton  # noqa: F401  (the tuned launcher's grids)

from .. import hardware
from ..kernels.gelu_backward import bias_gelu_backward_teaching
from ..kernels.gemm import check_operands
from ..tuned import gemm as G
from . import _lib

PLANS: dict = {}


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
        cfg = PLANS[key] = G._choose(cands, a, b, c, bias, M, N, K, 0.0, 0, gelu)
    G._launch(cfg, a, b, c, bias, M, N, K, 0.0, 0, gelu)
    return c


def _check(x, weight, bias):
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear_gelu: weight must be (out_features, in_features) with in_features = "
                         f"x.shape[-1] = {x.shape[-1]}, got {tuple(getattr(weight, 'shape', ()))}")


def linear_gelu_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    _check(x, weight, bias)
    y = matmul(x.reshape(-1, x.shape[-1]), weight.t(), bias, gelu=True)
    return y.view(*x.shape[:-1], weight.shape[0])


def _fake_fwd(x, weight, bias):
    _check(x, weight, bias)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def linear_gelu_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor):
    x2 = x.reshape(-1, x.shape[-1])
    acc = matmul(x2, weight.t())                          # z - b, recomputed rather than stored
    dy2 = dy.reshape(acc.shape)
    dy2 = dy2.to(acc.dtype) if dy2.dtype != acc.dtype else dy2
    dz, db = bias_gelu_backward_teaching(dy2.contiguous(), acc, bias)
    dx = matmul(dz, weight)                               # (M, N) @ (N, K)
    dw = matmul(dz.t(), x2)                               # (N, M) @ (M, K)
    return dx.view(x.shape), dw, db


def _fake_bwd(dy, x, weight, bias):
    return (x.new_empty(x.shape), torch.empty_like(weight, memory_format=torch.contiguous_format),
            torch.empty_like(bias, memory_format=torch.contiguous_format))


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy):
    x, weight, bias = ctx.saved_tensors
    return ctx.bwd(dy, x, weight, bias)


FWD = _lib.kernel_op("linear_gelu", "(Tensor x, Tensor weight, Tensor bias) -> Tensor", linear_gelu_fwd, _fake_fwd)
BWD = _lib.kernel_op("linear_gelu_bwd", "(Tensor dy, Tensor x, Tensor weight, Tensor bias) -> (Tensor, Tensor, Tensor)",
                     linear_gelu_bwd, _fake_bwd)
_lib.autograd(FWD, _setup, _backward, BWD)
torch.library.register_autocast("course::linear_gelu", "cuda", torch.bfloat16)
LinearGelu = _lib.fast_function("LinearGelu", linear_gelu_fwd, _setup, _backward, linear_gelu_bwd)
