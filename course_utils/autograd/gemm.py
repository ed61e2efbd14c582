"""Chapter 9's GEMM with its bias + GELU epilogue as a ``torch.autograd.Function`` (chapter 11).

Forward: one kernel, ``y = gelu(x @ w + b)``; the pre-activation ``z = x @ w + b`` stays in
registers and is never written. Backward needs ``gelu'(z)``, so it **recomputes** z, the trade
FlashAttention makes for its attention matrix: one more GEMM instead of storing an M x N tensor
(M x N x 2 bytes of activation memory in bf16). Then

    dz = dy * gelu'(z)   (with db, chapter 11's GELU backward kernel)
    dx = dz @ w^T        dw = x^T @ dz        (the course's tuned GEMM, any strides)

so a step costs four GEMMs of this shape instead of three. ``linear_gelu(x, w, b)`` takes ``w`` as
``nn.Linear`` lays it out, (out_features, in_features), and any leading dims on ``x``.
"""

from __future__ import annotations

import torch

from ..kernels.gelu_backward import bias_gelu_backward_teaching
from ..tuned import gemm
from .elementwise import AMP, AMP_BWD


class LinearGelu(torch.autograd.Function):
    """``gelu_tanh(x @ w + b)`` with x (M, K), w (K, N), b (N,): chapter 9's fused kernel both ways."""

    @staticmethod
    @AMP
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w, b)
        return gemm.linear_gelu(x, w, b)

    @staticmethod
    @AMP_BWD
    def backward(ctx, dy):
        x, w, b = ctx.saved_tensors
        acc = gemm.matmul(x, w)                      # z - b, recomputed rather than stored
        dz, db = bias_gelu_backward_teaching(dy.contiguous().to(acc.dtype), acc, b)
        dx = gemm.matmul(dz, w.t())
        dw = gemm.matmul(x.t(), dz)
        return dx, dw, db


def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(x @ weight.T + bias)``, differentiable through the course's GEMM kernels."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"weight must be (out_features, in_features) with in_features = x.shape[-1] = "
                         f"{x.shape[-1]}, got {tuple(weight.shape)}")
    lead = x.shape[:-1]
    y = LinearGelu.apply(x.reshape(-1, x.shape[-1]), weight.t(), bias)
    return y.reshape(*lead, weight.shape[0])
