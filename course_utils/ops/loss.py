"""``course::cross_entropy(logits, targets) -> loss``: the float32 mean of -log softmax(logits)[target],
by :mod:`course_utils.kernels.cross_entropy` (one kernel reads the logits once with chapter 6's online
softmax and saves each row's logsumexp; one kernel writes the gradient, reading ``dloss`` on the device).

The gradient goes to a new buffer, not into the logits: a custom op may not write into its input
unless its schema says it mutates it, and the logits may still be needed by others (the float32
reference of a test, a second loss). The tile (vocabulary block, warps) is a function of the vocabulary
size and is kept in ``PLANS``; the inputs are checked once per layout (``CHECKED``), and the kernels of
:mod:`course_utils.kernels.cross_entropy` are launched with the teaching launchers' arguments through
the ops' cheaper launch (:func:`course_utils.ops._lib.launch`).
"""

from __future__ import annotations

import torch

from ..kernels import cross_entropy as K
from ..state import RuntimeCache
from . import _lib

PLANS: dict = RuntimeCache()
CHECKED: set = set()   # the input layouts whose checks passed


def _plan(n_cols: int) -> dict:
    plan = PLANS.get(n_cols)
    if plan is None:
        block = K.block_size(n_cols)
        plan = PLANS[n_cols] = {"block": block, "num_warps": 4 if block <= 1024 else 8, "num_stages": 2}
    return plan


def _check_once(logits: torch.Tensor, targets: torch.Tensor, what: str = "cross_entropy", dloss=None) -> None:
    """The kernels' input checks, once per (shapes, strides, dtypes, devices) of the inputs: what they check
    depends on nothing else."""
    key = (what, logits.shape, logits.stride(), logits.dtype, logits.device, targets.shape, targets.stride(),
           targets.dtype, targets.device, None if dloss is None else (type(dloss), getattr(dloss, "shape", None),
                                                                      getattr(dloss, "device", None)))
    if key not in CHECKED:
        K.check(logits, targets, what)
        if dloss is not None and (not isinstance(dloss, torch.Tensor) or dloss.numel() != 1
                                  or dloss.device != logits.device):
            raise ValueError(f"cross_entropy backward: dloss must be a one-element tensor on {logits.device}")
        CHECKED.add(key)


def cross_entropy_fwd(logits: torch.Tensor, targets: torch.Tensor):
    """``cross_entropy_teaching``'s launch with this module's plan, the inputs checked once per layout."""
    _check_once(logits, targets)
    n_rows, n_cols = logits.shape
    plan = _plan(n_cols)
    losses = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(losses)
    if n_rows == 0:
        return losses.sum() / 0.0, lse   # the mean of no rows: NaN, as F.cross_entropy
    _lib.launch(K.cross_entropy_fwd_kernel, "ce_fwd", (n_rows,), (losses, lse, logits, targets, n_cols,
                                                                   logits.stride(0)),
                dict(BLOCK_SIZE=plan["block"], NUM_STAGES=plan["num_stages"], num_warps=plan["num_warps"]))
    return losses.mean(), lse


def _fake_fwd(logits, targets):
    K.check(logits, targets)
    return logits.new_empty((), dtype=torch.float32), logits.new_empty(logits.shape[:1], dtype=torch.float32)


def cross_entropy_bwd(dloss: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor):
    """``cross_entropy_backward_teaching``'s launch with this module's plan, the inputs checked once per layout."""
    _check_once(logits, targets, "cross_entropy backward", dloss)
    n_rows, n_cols = logits.shape
    plan = _plan(n_cols)
    # contiguous (the kernel writes rows n_cols apart); empty_strided parses its int tuples for ~1.3 us where
    # torch.empty((n_rows, n_cols), ...) takes ~2-2.9 (CPU, min of repeats; the strides are torch's own for a 0 dim)
    dlogits = torch.empty_strided((n_rows, n_cols), (max(n_cols, 1), 1), dtype=logits.dtype, device=logits.device)
    if n_rows:
        _lib.launch(K.cross_entropy_bwd_kernel, "ce_bwd", (n_rows,),
                    (dlogits, logits, targets, lse, dloss, n_cols, logits.stride(0), n_cols, 1.0 / n_rows),
                    dict(BLOCK_SIZE=plan["block"], NUM_STAGES=plan["num_stages"], num_warps=plan["num_warps"]))
    return dlogits


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
