"""``course::linear_cross_entropy(h, weight, targets, ignore_index=-100) -> loss``: the float32 mean of
CE(h @ weight.T, targets) over the rows not ignored, by :mod:`course_utils.tuned.linear_cross_entropy`
(chunks of rows: cuBLAS for the three GEMMs, the fused classifier kernel for the loss and, in place over
the chunk's logits, their gradient). The (rows x vocab) logits never exist in full, nor in float32.

The forward op returns ``(loss, dh, dweight)``: the gradients are computed with the loss, because the loss
is the end of the graph. The backward op multiplies them by the incoming gradient on the device (no host
sync; a CUDA graph replays it). No GEMM runs in the backward, and no logits are saved between the passes:
what autograd keeps is dh (rows x d) and dweight (vocab x d), in the inputs' dtypes.

The chunk size is a function of (rows, vocab, dtype) (:func:`course_utils.tuned.linear_cross_entropy.
chunk_rows_for`) and is kept in ``PLANS``. Under autocast the wrapper casts h and weight to the autocast
dtype first, as a matrix product would be.
"""

from __future__ import annotations

import torch

from ..kernels import fused_classifier as K
from ..state import RuntimeCache
from ..tuned import linear_cross_entropy as T
from . import _lib

PLANS: dict = RuntimeCache()


def _plan(rows: int, vocab: int, dtype: torch.dtype) -> dict:
    key = (rows, vocab, dtype)
    plan = PLANS.get(key)
    if plan is None:
        itemsize = torch.empty((), dtype=dtype).element_size()
        plan = PLANS[key] = {"chunk_rows": T.chunk_rows_for(rows, vocab, itemsize)}
    return plan


def linear_ce_fwd(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int):
    T.check(h, weight, targets)
    return T.linear_cross_entropy_forward(h, weight, targets, ignore_index,
                                          **_plan(h.shape[0], weight.shape[0], h.dtype))


def _fake_fwd(h, weight, targets, ignore_index):
    T.check(h, weight, targets)
    return (h.new_empty((), dtype=torch.float32), h.new_empty(h.shape, dtype=h.dtype),
            weight.new_empty(weight.shape, dtype=weight.dtype))


def linear_ce_bwd(dloss: torch.Tensor, dh: torch.Tensor, dweight: torch.Tensor):
    return T.linear_cross_entropy_backward(dloss, dh, dweight)


def _fake_bwd(dloss, dh, dweight):
    return torch.empty_like(dh), torch.empty_like(dweight)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(output[1], output[2])


def _backward(ctx, dloss, _ddh=None, _ddweight=None):
    if dloss is None:
        return None, None, None, None
    dh, dweight = ctx.saved_tensors
    gh, gw = ctx.bwd(dloss, dh, dweight)
    return gh, gw, None, None


FWD = _lib.kernel_op("linear_cross_entropy_fwd",
                     "(Tensor h, Tensor weight, Tensor targets, int ignore_index) -> (Tensor, Tensor, Tensor)",
                     linear_ce_fwd, _fake_fwd)
BWD = _lib.kernel_op("linear_cross_entropy_bwd", "(Tensor dloss, Tensor dh, Tensor dweight) -> (Tensor, Tensor)",
                     linear_ce_bwd, _fake_bwd)
_lib.autograd(FWD, _setup, _backward, BWD)
_lib.public_op("linear_cross_entropy", "(Tensor h, Tensor weight, Tensor targets, int ignore_index=-100) -> Tensor",
               lambda h, weight, targets, ignore_index=K.IGNORE_INDEX:
               torch.ops.course.linear_cross_entropy_fwd(h, weight, targets, ignore_index)[0])
LinearCrossEntropy = _lib.fast_function("LinearCrossEntropy", linear_ce_fwd, _setup, _backward, linear_ce_bwd)


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         ignore_index: int = K.IGNORE_INDEX) -> torch.Tensor:
    """``F.cross_entropy(h @ weight.T, targets, ignore_index=ignore_index)`` as a float32 scalar, h (rows, d),
    weight (vocab, d) (a tied head: the token embedding), targets (rows,) int64 or int32."""
    h, weight = _lib.cast(_lib.autocast_dtype(h.device.type), h, weight)   # traced too: a custom op has no autocast
    if torch.compiler.is_compiling():
        return torch.ops.course.linear_cross_entropy(h, weight, targets, ignore_index)
    return LinearCrossEntropy.run(h, weight, targets, int(ignore_index))
