"""LayerNorm and RMSNorm as ``torch.autograd.Function``s on the tuned kernels (chapters 10 and 11).

The forward saves x, the weight and the float32 statistics (mean and rstd, 8 bytes a row); the
backward computes dx, dw and db with :func:`course_utils.tuned.layernorm._backward` (partial sums
per program, then a second reduction: deterministic). Inputs are checked there, with clear errors.
"""

from __future__ import annotations

import torch

from .layernorm import _backward, _forward


class LayerNormFunction(torch.autograd.Function):
    """``LayerNormFunction.apply(x, weight, bias, eps)``: the tuned kernels with autograd."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, mean, rstd = _forward(x, weight, bias, eps, False, True, "LayerNormFunction")
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = _backward(dy.contiguous(), x, weight, mean, rstd, False, False, "LayerNormFunction.backward")
        return dx, dw, db if ctx.has_bias else None, None


class RMSNormFunction(torch.autograd.Function):
    """``RMSNormFunction.apply(x, weight, eps)``: the tuned kernels with autograd."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, _, rstd = _forward(x, weight, None, eps, True, True, "RMSNormFunction")
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw, _ = _backward(dy.contiguous(), x, weight, None, rstd, True, False, "RMSNormFunction.backward")
        return dx, dw, None


def layer_norm_autograd(x, weight, bias=None, eps: float = 1e-5):
    """LayerNorm that autograd can differentiate (x, weight and bias)."""
    return LayerNormFunction.apply(x, weight, bias, eps)


def rms_norm_autograd(x, weight, eps: float = 1e-6):
    """RMSNorm that autograd can differentiate (x and weight)."""
    return RMSNormFunction.apply(x, weight, eps)
