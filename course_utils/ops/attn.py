"""``course::attention(q, k, v, causal, scale) -> o``: chapter 7's tuned FlashAttention forward and
chapter 11's tuned backward, on q (B, H, N, d) and k, v (B, H_kv, N_kv, d) of ANY strides.

The kernels take every tensor's four strides, so q, k and v can be the views of a packed QKV
projection, ``qkv.view(B, N, 3, H, d).permute(2, 0, 3, 1, 4)``, with no ``.contiguous()`` copy. The
output is allocated as (B, N, H, d) and returned as its (B, H, N, d) permuted view, so the output
projection's ``o.transpose(1, 2).reshape(B, N, H * d)`` is a view, not a copy. Causal masks align
bottom-right (query i sees keys j <= i + N_kv - N), as everywhere in the course. Gradients are
contiguous (B, H, N, d) tensors (the backward kernels write them so); autograd maps them back
through the views.

Tile choices (forward and backward) are timed once per (batch, heads, head dim, sequence lengths
rounded up to a power of two, dtype, device, causal) and kept in ``PLANS``:
:func:`course_utils.ops.warmup` makes those first calls, and decoding against a growing KV cache
times them once per doubling of its length. The inputs are checked once per (shapes, dtypes,
devices): the checks depend on nothing else. A tile chosen with tensor descriptors still runs on
inputs whose alignment rules them out (the launcher falls back to pointer loads).
"""

from __future__ import annotations

import math

import torch

from .. import hardware
from ..kernels.attention import validate
from ..kernels.attention_backward import row_delta
from ..tuned import attention as F_
from ..tuned import attention_backward as B_
from . import _lib

PLANS: dict = {}
VALID: set = set()   # the (shapes, dtypes, devices) whose inputs passed the checks


def _scale(q, scale: float) -> float:
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"attention: scale must be a positive finite float (1/sqrt(d) = "
                         f"{q.shape[-1] ** -0.5:.4g} is usual), got {scale}")
    return float(scale)


def _empty_out(q: torch.Tensor) -> torch.Tensor:
    B, H, N, D = q.shape
    return q.new_empty((B, N, H, D)).permute(0, 2, 1, 3)


def _meta(*ts):
    """What the checks depend on: shapes, dtypes and devices (strides go to the kernel)."""
    return tuple((t.shape, t.dtype, t.device) for t in ts)


def _plan_key(what: str, causal: bool, q, k):
    """The tile choice's key: sequence lengths rounded up to a power of two (decoding with a growing KV
    cache times the candidates once per doubling, not once per token), the rest exact."""
    B, H, N, D = q.shape
    return (what, bool(causal), B, H, k.shape[1], D, _lib.next_pow2(N), _lib.next_pow2(k.shape[2]), q.dtype, q.device)


def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    scale = _scale(q, scale)
    checked = ("fwd", bool(causal), *_meta(q, k, v))
    if checked not in VALID:
        validate(q, k, v, causal)   # once per shapes, dtypes and devices: the same pass again
    B, H, N, D = q.shape
    o = _empty_out(q)
    lse = torch.empty((B, H, N), dtype=torch.float32, device=q.device)
    if o.numel() == 0:
        lse.fill_(float("-inf"))
        return o, lse
    VALID.add(checked)
    key = _plan_key("fwd", causal, q, k)
    cfg = PLANS.get(key)
    if cfg is None:
        cands = F_.attention_configs(hardware.device_info(q), D, q.dtype, causal)
        if _lib.tracing():
            cfg = cands[0]
        else:
            cfg = PLANS[key] = F_.choose(cands, key, lambda c: F_._launch_tuned(c, q, k, v, o, lse, scale, causal))
    F_._launch_tuned(cfg, q, k, v, o, lse, scale, causal)
    return o, lse


def _fake_fwd(q, k, v, causal, scale):
    B, H, N, _ = q.shape
    return _empty_out(q), q.new_empty((B, H, N), dtype=torch.float32)


def attention_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                  lse: torch.Tensor, causal: bool, scale: float):
    checked = ("bwd", bool(causal), *_meta(q, k, v, o, lse, do))
    if checked not in VALID or not lse.is_contiguous():
        B_.check_backward_inputs(q, k, v, o, lse, do, causal)
        VALID.add(checked)
    B, H, N, D = q.shape
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    delta = row_delta(o, do)
    key = _plan_key("bwd", causal, q, k)
    cfg = PLANS.get(key)
    if cfg is None:
        cands = B_.backward_configs(hardware.device_info(q), D, q.dtype)
        if _lib.tracing():
            cfg = cands[0]
        else:
            cfg = PLANS[key] = F_.choose(cands, key, lambda c: B_._launch(c, q, k, v, do, lse, delta, dq, dk, dv,
                                                                           scale, causal))
    B_._launch(cfg, q, k, v, do, lse, delta, dq, dk, dv, scale, causal)
    return dq, dk, dv


def _fake_bwd(do, q, k, v, o, lse, causal, scale):
    return tuple(t.new_empty(t.shape) for t in (q, k, v))


def _setup(ctx, inputs, output):
    q, k, v, causal, scale = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.causal, ctx.scale = causal, scale


def _backward(ctx, do, _dlse=None):
    if do is None:
        return None, None, None, None, None
    q, k, v, o, lse = ctx.saved_tensors
    if do.dtype != q.dtype:
        do = do.to(q.dtype)
    dq, dk, dv = ctx.bwd(do, q, k, v, o, lse, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None


FWD = _lib.kernel_op("attention_fwd", "(Tensor q, Tensor k, Tensor v, bool causal, float scale) -> (Tensor, Tensor)",
                     attention_fwd, _fake_fwd)
BWD = _lib.kernel_op("attention_bwd", "(Tensor do, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, bool causal, "
                     "float scale) -> (Tensor, Tensor, Tensor)", attention_bwd, _fake_bwd)
_lib.autograd(FWD, _setup, _backward, BWD)
torch.library.register_autocast("course::attention_fwd", "cuda", torch.bfloat16)
_lib.public_op("attention", "(Tensor q, Tensor k, Tensor v, bool causal, float scale) -> Tensor",
               lambda q, k, v, causal, scale: torch.ops.course.attention_fwd(q, k, v, causal, scale)[0])
Attention = _lib.fast_function("Attention", attention_fwd, _setup, _backward, attention_bwd)
