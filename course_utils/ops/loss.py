"""``course::cross_entropy(logits, targets) -> loss``: the float32 mean of -log softmax(logits)[target],
by :mod:`course_utils.kernels.cross_entropy` (one kernel reads the logits once with chapter 6's online
softmax and saves each row's logsumexp; one kernel writes the gradient, reading ``dloss`` on the device).

The gradient goes to a new buffer, not into the logits: a custom op may not write into its input
unless its schema says it mutates it, and the logits may still be needed by others (the float32
reference of a test, a second loss). The tile (vocabulary block, warps) is a function of the vocabulary
size and is kept in ``PLANS``.
"""

from __future__ import annotations

import torch

from ..kernels import cross_entropy as K
from . import _lib

PLANS: dict = {}


def _plan(n_cols: int) -> dict:
    plan = PLANS.get(n_cols)
    if plan is None:
        block = K.block_size(n_cols)
        plan = PLANS[n_cols] = {"block": block, "num_warps": 4 if block <= 1024 else 8, "num_stages": 2}
    return plan


def cross_entropy_fwd(logits: torch.Tensor, targets: torch.Tensor):
    K.check(logits, targets)
    return K.cross_entropy_teaching(logits, targets, **_plan(logits.shape[1]))


def _fake_fwd(logits, targets):
    K.check(logits, targets)
    return logits.new_empty((), dtype=torch.float32), logits.new_empty(logits.shape[:1], dtype=torch.float32)


def cross_entropy_bwd(dloss: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor):
    return K.cross_entropy_backward_teaching(dloss, logits, targets, lse, **_plan(logits.shape[1]))


def _fake_bwd(dloss, logits, targets, lse):
    return logits.new_empty(logits.shape)


def _setup(ctx, inputs, output):
    logits, targets = inputs
    ctx.save_for_backward(logits, targets, output[1])


def _backward(ctx, dloss, _dlse=None):
    if dloss is None:
        return None, None
    logits, targets, lse = ctx.saved_tensors
    return ctx.bwd(dloss, logits, targets, lse), None


FWD = _lib.kernel_op("cross_entropy_fwd", "(Tensor logits, Tensor targets) -> (Tensor, Tensor)",
                     cross_entropy_fwd, _fake_fwd)
BWD = _lib.kernel_op("cross_entropy_bwd", "(Tensor dloss, Tensor logits, Tensor targets, Tensor lse) -> Tensor",
                     cross_entropy_bwd, _fake_bwd)
_lib.autograd(FWD, _setup, _backward, BWD)
_lib.public_op("cross_entropy", "(Tensor logits, Tensor targets) -> Tensor",
               lambda logits, targets: torch.ops.course.cross_entropy_fwd(logits, targets)[0])
CrossEntropy = _lib.fast_function("CrossEntropy", cross_entropy_fwd, _setup, _backward, cross_entropy_bwd)
