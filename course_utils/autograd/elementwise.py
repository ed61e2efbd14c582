"""Bias + GELU (+ dropout) as a ``torch.autograd.Function`` (chapter 11).

Forward: chapter 4's fused kernel (one read of x, one write of y). Saved for backward: ``x`` and
``b`` only (the inputs: autograd keeps them anyway), plus the seed, never the keep mask: the
backward kernel (:mod:`course_utils.kernels.gelu_backward`) recomputes ``z = x + b`` and regenerates
the mask from the seed and each element's index.
"""

from __future__ import annotations

import torch

from ..kernels.gelu_backward import bias_gelu_backward_teaching
from ..kernels.layouts import is_dense, lead_layout
from ..tuned import elementwise

AMP = torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.bfloat16)  # under autocast: bf16 in
AMP_BWD = torch.amp.custom_bwd(device_type="cuda")


class BiasGeluDropout(torch.autograd.Function):
    """``y = dropout(gelu(x + bias), p)`` with the mask drawn from ``seed`` (``p = 0``: no dropout)."""

    @staticmethod
    @AMP
    def forward(ctx, x, bias, p: float, seed: int, approximate: str):
        if not (x.is_contiguous() or (is_dense(x) and lead_layout(x) is not None)):
            x = x.contiguous()           # a slice with gaps: one copy; a dense x keeps its layout, so does y
        bias = bias.contiguous()
        if p > 0.0:
            y = elementwise.bias_gelu_dropout(x, bias, p, seed, approximate=approximate)
        else:
            y = elementwise.bias_gelu_scale(x, bias, 1.0, approximate=approximate)
        ctx.save_for_backward(x, bias)
        ctx.p, ctx.seed, ctx.approximate = p, seed, approximate
        return y

    @staticmethod
    @AMP_BWD
    def backward(ctx, dy):
        x, bias = ctx.saved_tensors
        dy = dy.to(x.dtype)
        if dy.stride() != x.stride() and not (dy.is_contiguous() and x.is_contiguous()):
            dy = torch.empty_like(x).copy_(dy)   # dy in x's layout (dx gets it too)
        dx, db = bias_gelu_backward_teaching(dy, x, bias, p=ctx.p, seed=ctx.seed, approximate=ctx.approximate)
        return dx, db, None, None, None


def bias_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """``gelu(x + bias)``, differentiable through the course's kernels."""
    return BiasGeluDropout.apply(x, bias, 0.0, 0, approximate)


def bias_gelu_dropout(x: torch.Tensor, bias: torch.Tensor, p: float, seed: int,
                      approximate: str = "tanh") -> torch.Tensor:
    """``dropout(gelu(x + bias), p)``, differentiable; the seed must change per call, layer and step."""
    return BiasGeluDropout.apply(x, bias, float(p), int(seed), approximate)
