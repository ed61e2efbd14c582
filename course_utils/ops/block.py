"""One pre-norm block of chapter 12's GPT, forward and backward, as plain calls of the ops' functions; and the
same block as one autograd node.

A block here runs from its first LayerNorm's output ``h`` and the residual stream ``x`` to the next
block's: ``qkv`` projection, attention, ``proj``, the residual add fused with LayerNorm 2, the MLP
(``linear_gelu``, ``out``), and the residual add fused with the *next* LayerNorm (the next block's first, or
the final one). That is where the course's model puts its fused adds, so the block boundary cuts no kernel.

:func:`block_forward` and :func:`block_backward` are the step by hand's (:class:`course_utils.step.HandStep`):
no autograd engine, the parameters' gradients returned. :class:`BlockFunction` wraps the very same two
functions in one ``torch.autograd.Function``: autograd then records one node a block, where the model's
op-by-op path records eighteen (four course ops; three linears with their transposes; views), and calls one
Python backward a block. The kernels, their order and so the gradients are the same (tests/test_block.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from . import attn as _A
from . import linear as _L
from . import norms as _Nm

#: the ops' Python functions (eager), in the order the block unpacks them: norms, attention, linear_gelu
FUNCTIONS = (_Nm, _A, _L)


@dataclass
class Saved:
    """What one block's backward reads: the inputs of its GEMMs, attention's output and statistics,
    and each fused residual add + LayerNorm's sum and statistics."""
    h1: torch.Tensor          # the block's input h: the qkv projection's input
    qkv: torch.Tensor
    o: torch.Tensor           # attention's output, (B, H, N, hd) view of (B, N, H, hd) memory
    lse: torch.Tensor
    o2: torch.Tensor          # o as (B, N, d): the output projection's input
    s1: torch.Tensor          # residual stream after the attention branch
    mean1: torch.Tensor
    rstd1: torch.Tensor
    h2: torch.Tensor          # LayerNorm 2's output: the MLP's input
    acc: torch.Tensor         # linear_gelu's saved pre-activation (empty for the GEMM-epilogue plan)
    f: torch.Tensor           # GELU's output: the second MLP GEMM's input
    s2: torch.Tensor          # residual stream after the MLP branch
    mean2: torch.Tensor
    rstd2: torch.Tensor


def params_of(blk, nxt) -> tuple:
    """The block's parameters in :func:`block_forward`'s order; ``nxt`` is the LayerNorm after the block."""
    return (blk.qkv.weight, blk.qkv.bias, blk.proj.weight, blk.proj.bias, blk.ln2.weight, blk.ln2.bias,
            blk.fc.weight, blk.fc.bias, blk.out.weight, blk.out.bias, nxt.weight, nxt.bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """x @ W.T + b over the last dim, one cuBLAS call (what ``F.linear`` runs)."""
    y = torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight.t())
    return y.view(*x.shape[:-1], weight.shape[0])


def linear_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor):
    """(dx, dW, db): dx = dy @ W, dW = dy.T @ x, db = the column sums of dy."""
    dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
    return torch.mm(dy2, weight).view(x.shape), torch.mm(dy2.t(), x2), dy2.sum(0)


def block_forward(kernels, h, x, p: tuple, n_head: int, eps: float, scale: float):
    """(h, x, saved): the next LayerNorm's output (h's dtype), the residual stream after the block (x's dtype)."""
    Nm, A, L = kernels
    qkv_w, qkv_b, proj_w, proj_b, ln2_w, ln2_b, fc_w, fc_b, out_w, out_b, nxt_w, nxt_b = p
    B, N, _ = h.shape
    qkv = linear(h, qkv_w, qkv_b)
    o, lse = A.attention_qkv_fwd(qkv, n_head, True, scale)
    o2 = o.transpose(1, 2).reshape(B, N, -1)
    h2, s1, mean1, rstd1 = Nm.add_layer_norm_fwd(linear(o2, proj_w, proj_b), x, ln2_w, ln2_b, eps)
    f, acc = L.linear_gelu_fwd(h2, fc_w, fc_b)
    hn, s2, mean2, rstd2 = Nm.add_layer_norm_fwd(linear(f, out_w, out_b), s1, nxt_w, nxt_b, eps)
    return hn, s2, Saved(h, qkv, o, lse, o2, s1, mean1, rstd1, h2, acc, f, s2, mean2, rstd2)


def block_backward(kernels, dh, dres, sv: Saved, p: tuple, n_head: int, scale: float):
    """(dh_in, dx_in, grads): the gradients of the block's inputs h and x, and of its parameters in
    :func:`params_of`'s order. ``dh``: the next LayerNorm's output's; ``dres``: the stream's after the block
    (None: nothing reads it)."""
    Nm, A, L = kernels
    qkv_w, _, proj_w, _, ln2_w, _, fc_w, fc_b, out_w, _, nxt_w, _ = p
    compute = sv.h1.dtype                          # the branches' dtype; the stream may be wider (float32)
    # hn, s2 = add_layer_norm(out(f), s1): both inputs of the add get ds
    # (ds_c: the branch's copy of ds in its dtype, written by the norm's kernel beside ds)
    ds, ds_c, dnxt_w, dnxt_b = Nm.add_layer_norm_bwd_low(dh, dres, sv.s2, nxt_w, sv.mean2, sv.rstd2, compute)
    df, dout_w, dout_b = linear_backward(ds_c, sv.f, out_w)
    dh2, dfc_w, dfc_b = L.linear_gelu_bwd(df, sv.h2, fc_w, fc_b, sv.acc)
    # h2, s1 = add_layer_norm(proj(o2), x)
    dx, dx_c, dln2_w, dln2_b = Nm.add_layer_norm_bwd_low(dh2, ds, sv.s1, ln2_w, sv.mean1, sv.rstd1, compute)
    do2, dproj_w, dproj_b = linear_backward(dx_c, sv.o2, proj_w)
    do = do2.view(sv.o.shape[0], sv.o.shape[2], sv.o.shape[1], sv.o.shape[3]).transpose(1, 2)
    dqkv = A.attention_qkv_bwd(do, sv.qkv, sv.o, sv.lse, n_head, True, scale)
    dh_in, dqkv_w, dqkv_b = linear_backward(dqkv, sv.h1, qkv_w)
    return dh_in, dx, (dqkv_w, dqkv_b, dproj_w, dproj_b, dln2_w, dln2_b, dfc_w, dfc_b, dout_w, dout_b,
                       dnxt_w, dnxt_b)


class BlockFunction(torch.autograd.Function):
    """:func:`block_forward` and :func:`block_backward` as one autograd node (the ops' eager functions)."""

    @staticmethod
    def forward(ctx, h, x, n_head: int, eps: float, scale: float, *p):
        ctx.set_materialize_grads(False)           # the stream after the last block feeds nothing: None
        hn, xn, sv = block_forward(FUNCTIONS, h, x, p, n_head, eps, scale)
        ctx.save_for_backward(*(getattr(sv, f.name) for f in fields(Saved)), *p)   # (astuple would copy)
        ctx.n_head, ctx.scale = n_head, scale
        return hn, xn

    @staticmethod
    def backward(ctx, dh, dres):
        saved = ctx.saved_tensors
        n = len(fields(Saved))
        sv, p = Saved(*saved[:n]), saved[n:]
        if dh is None:                             # a caller that reads only the stream
            dh = torch.zeros_like(sv.h2)
        dh_in, dx, grads = block_backward(FUNCTIONS, dh, dres, sv, p, ctx.n_head, ctx.scale)
        return (dh_in, dx, None, None, None, *grads)


def block(h: torch.Tensor, x: torch.Tensor, blk, nxt, n_head: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, x)`` after one block (:class:`course_utils.gpt.Block` ``blk``, then the LayerNorm ``nxt``), one
    autograd node; the block's kernels are the op-by-op path's."""
    scale = (h.shape[-1] // n_head) ** -0.5
    return BlockFunction.apply(h, x, int(n_head), float(eps), scale, *params_of(blk, nxt))
