"""``course::bias_gelu_dropout(x, bias, p, seed_tensor) -> y``: :mod:`course_utils.tuned.bias_gelu_dropout`
(chapter 4's fused forward and chapter 11's backward, the Philox seed read from ``seed_tensor`` on the
device). The backward reads the same tensor: bump it after the backward pass, not between forward and
backward (the backward would then regenerate a different mask). Several dropout layers in one step
need different seeds: give each its own element of one int64 tensor (``seeds[i:i + 1]``) and bump
them all at once (``seeds.add_(len(seeds))``).
"""

from __future__ import annotations

import torch

from ..tuned import bias_gelu_dropout as K
from . import _lib


def bias_gelu_dropout_fwd(x: torch.Tensor, bias: torch.Tensor, p: float, seed_tensor: torch.Tensor):
    return K.bias_gelu_dropout(x, bias, p, seed_tensor)


def _fake_fwd(x, bias, p, seed_tensor):
    K.check(x, bias, p, seed_tensor)
    return K.output_like(x)   # the real op's layout: x's strides when dense, else contiguous


def bias_gelu_dropout_bwd(dy, x, bias, p: float, seed_tensor):
    return K.bias_gelu_dropout_backward(dy, x, bias, p, seed_tensor)


def _fake_bwd(dy, x, bias, p, seed_tensor):
    return K.output_like(x), torch.empty_like(bias)


def _setup(ctx, inputs, output):
    x, bias, p, seed_tensor = inputs
    ctx.save_for_backward(x, bias, seed_tensor)
    ctx.p = p


def _backward(ctx, dy):
    x, bias, seed_tensor = ctx.saved_tensors
    dx, db = ctx.bwd(dy, x, bias, ctx.p, seed_tensor)
    return dx, db, None, None


FWD = _lib.kernel_op("bias_gelu_dropout", "(Tensor x, Tensor bias, float p, Tensor seed_tensor) -> Tensor",
                     bias_gelu_dropout_fwd, _fake_fwd)
BWD = _lib.kernel_op("bias_gelu_dropout_bwd", "(Tensor dy, Tensor x, Tensor bias, float p, Tensor seed_tensor) -> "
                     "(Tensor, Tensor)", bias_gelu_dropout_bwd, _fake_bwd)
_lib.autograd(FWD, _setup, _backward, BWD)
torch.library.register_autocast("course::bias_gelu_dropout", "cuda", torch.bfloat16)
BiasGeluDropout = _lib.fast_function("BiasGeluDropout", bias_gelu_dropout_fwd, _setup, _backward,
                                     bias_gelu_dropout_bwd, public=None)
