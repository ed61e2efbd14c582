"""The course's fast ops as PyTorch operators (chapter 12): ``torch.ops.course.<name>``.

One public face for the course's production kernels, for users and for the model of chapter 12:

=====================================  ==========================================================
``layer_norm(x, weight, bias, eps)``   chapter 10's LayerNorm, forward and backward
``add_layer_norm(x, residual, w, b,    ``(y, s)``: s = x + residual, y = LayerNorm(s), one kernel each
eps)``                                 way (:mod:`course_utils.kernels.add_layernorm`)
``linear_gelu(x, weight, bias)``       gelu_tanh(x @ weight.T + bias): cuBLAS + chapter 4's kernel, or chapter 9's
                                       GEMM epilogue, whichever is faster for the shape
``attention(q, k, v, causal, scale)``  FlashAttention, q/k/v of any strides, o in (B, N, H, d) memory
``attention_qkv(qkv, n_head, causal,   the same on a packed (B, N, 3 H d) projection; dqkv written packed
scale)``
``cross_entropy(logits, targets)``     mean loss, one kernel each way (chapter 6's online softmax)
``linear_cross_entropy(h, weight,      the mean loss of h @ weight.T: cuBLAS's logits by chunks of rows, one
targets)``                             kernel writes each chunk's loss and gradient in place (the LM head)
``bias_gelu_dropout(x, bias, p,        dropout(gelu(x + bias)) with the Philox seed read from a device
seed_tensor)``                         tensor (a CUDA graph draws a new mask when the seed is bumped)
=====================================  ==========================================================

Importing :mod:`course_utils.ops` registers them (and compiles nothing). Each is registered with
``torch.library`` (custom ops with fake implementations and
``register_autograd``), so ``torch.compile(fullgraph=True)`` traces a model built on them and
``torch.library.opcheck`` passes. The functions of this module with the same names are the calls to
use: from eager Python they run an ``autograd.Function`` over the very same forward and backward
functions (no dispatcher on the hot path); while ``torch.compile`` traces, they call
``torch.ops.course.<name>``. Under autocast the wrappers cast the matrix-product inputs to autocast's dtype
themselves, in eager and while tracing alike (a custom op has no autocast rule of its own).
Tile choices are made by :func:`warmup` (or the first call of a
shape) and cached per (shape, dtype, device); :func:`host_overhead_table` measures what a call costs
the host against its aten counterpart.
"""

from __future__ import annotations

import torch

from . import _lib
from . import attn as _attention
from . import dropout as _dropout
from . import linear as _linear
from . import loss as _loss
from . import norms as _norms
from .linear_ce import linear_cross_entropy
from .overhead import host_overhead_table, warmup

__all__ = ["layer_norm", "add_layer_norm", "linear_gelu", "attention", "attention_qkv", "cross_entropy",
           "bias_gelu_dropout", "linear_cross_entropy", "warmup", "host_overhead_table", "OPS"]

OPS = ("layer_norm", "add_layer_norm", "linear_gelu", "attention", "cross_entropy", "bias_gelu_dropout")
_compiling = torch.compiler.is_compiling


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dim (x of any leading dims; weight and bias of x.shape[-1])."""
    if _compiling():
        return torch.ops.course.layer_norm(x, weight, bias, eps)
    return _norms.LayerNorm.run(x, weight, bias, float(eps))


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                   eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, s)`` with ``s = x + residual`` (the new residual stream) and ``y = LayerNorm(s)``."""
    if _compiling():
        return torch.ops.course.add_layer_norm(x, residual, weight, bias, eps)
    return _norms.AddLayerNorm.run(x, residual, weight, bias, float(eps))


def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(x @ weight.T + bias)``, weight (out_features, in_features) as in ``nn.Linear``."""
    x, weight, bias = _lib.cast(_lib.autocast_dtype(x.device.type), x, weight, bias)
    if _compiling():
        return torch.ops.course.linear_gelu(x, weight, bias)
    return _linear.LinearGelu.run(x, weight, bias)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale [+ causal, bottom-right]) v; q (B, H, N, d), k/v (B, H_kv, N_kv, d), any
    strides; the result is a (B, H, N, d) view of (B, N, H, d) memory. ``scale`` defaults to 1/sqrt(d);
    ``causal`` defaults to False, as SDPA's ``is_causal`` does (a causal mask is asked for, never assumed)."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    q, k, v = _lib.cast(_lib.autocast_dtype(q.device.type), q, k, v)
    if _compiling():
        return torch.ops.course.attention(q, k, v, bool(causal), scale)
    return _attention.Attention.run(q, k, v, bool(causal), scale)


def attention_qkv(qkv: torch.Tensor, n_head: int, causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """:func:`attention` on the q, k, v of a packed (B, N, 3 * n_head * hd) projection; its gradient comes
    back in the same packed layout, written there by the backward kernels (no gather of dq, dk, dv)."""
    hd = qkv.shape[-1] // (3 * n_head) if n_head > 0 else 1
    scale = hd ** -0.5 if scale is None else float(scale)
    (qkv,) = _lib.cast(_lib.autocast_dtype(qkv.device.type), qkv)
    if _compiling():
        return torch.ops.course.attention_qkv(qkv, int(n_head), bool(causal), scale)
    return _attention.AttentionQKV.run(qkv, int(n_head), bool(causal), scale)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean over rows of -log softmax(logits)[target] (float32 scalar); logits (rows, vocab)."""
    if _compiling():
        return torch.ops.course.cross_entropy(logits, targets)
    return _loss.CrossEntropy.run(logits, targets)


def bias_gelu_dropout(x: torch.Tensor, bias: torch.Tensor, p: float, seed_tensor: torch.Tensor) -> torch.Tensor:
    """``dropout(gelu_tanh(x + bias), p)``; the Philox seed is read from ``seed_tensor`` (int64, one element,
    on x's device) by the kernel: bump it in place (``seed_tensor.add_(1)``) after the backward pass to
    draw a new mask, also inside a CUDA graph."""
    x, bias = _lib.cast(_lib.autocast_dtype(x.device.type), x, bias)
    if _compiling():
        return torch.ops.course.bias_gelu_dropout(x, bias, float(p), seed_tensor)
    return _dropout.BiasGeluDropout.run(x, bias, float(p), seed_tensor)
