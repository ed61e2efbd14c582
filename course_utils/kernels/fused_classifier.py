"""The fused classifier (chapter 12): the loss and its gradient from one block of logits, the gradient
written over the logits themselves.

For a row r of logits x (vocab entries) and its target t:

    lse[r]  = log(sum_j exp(x[r, j]))                       (chapter 6's online max and sum)
    loss[r] = lse[r] - x[r, t]
    dx[r,j] = (exp(x[r, j] - lse[r]) - [j == t]) * scale    (softmax minus the one-hot target)

``scale`` is d(total loss)/d(loss[r]): 1/rows for a mean. The loss is the end of the graph, so the
gradient can be computed as soon as the loss is: this kernel writes it **in place over the logits**,
which nobody needs again. One program per row: pass 1 walks the row once for the max and the sum,
pass 2 walks it again (mostly from L2: a row of GPT-2's 50304 bf16 logits is 100 KB) and overwrites it.
So the logits are read twice and written once in their own dtype, never copied to float32, and no
``lse`` or probabilities are saved. Everything is computed in float32.

v1  ``fused_classifier_ref``: float64 torch (``log_softmax``, gather, autograd for the gradient).
v2  ``fused_classifier_kernel`` + ``fused_classifier_teaching``: the launcher. ``scale`` is a float, a one-element
    device tensor (read by the kernel: no host sync, a CUDA graph replays it), or None for the mean over
    the rows whose target is not ``ignore_index`` (that count is a device reduction, never read back).

Rows whose target equals ``ignore_index`` (default -100, as ``F.cross_entropy``) give loss 0 and
gradient 0. Any other target outside [0, vocab) gives NaN loss and a NaN gradient row: checking it on
the host would cost a sync, and NaN cannot go unnoticed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .cross_entropy import check as check_logits
from .cross_entropy import row_logsumexp, store_row_gradient

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_BLOCK = 4096          # vocabulary tile: GPT-2's 50304 logits are 13 tiles per pass
IGNORE_INDEX = -100       # F.cross_entropy's default


@triton.jit
def fused_classifier_kernel(logits_ptr, losses_ptr, targets_ptr, scale_ptr, scale_value, n_cols, row_stride,
                            ignore_index, SCALE_FROM_PTR: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                            NUM_STAGES: tl.constexpr):
    """Row ``pid``: losses[pid] = lse - x[target]; x <- (softmax(x) - onehot(target)) * scale."""
    # torch.compile passes floats as fp64: keep the math in float32 (tl.cast: the interpreter passes a Python float)
    scale_value = tl.cast(scale_value, tl.float32)
    pid = tl.program_id(0)
    row = logits_ptr + pid.to(tl.int64) * row_stride
    # pass 1: the row's logsumexp, online (chapter 6; the same function as cross_entropy_fwd_kernel's)
    lse = row_logsumexp(row, n_cols, BLOCK_SIZE, NUM_STAGES)

    target = tl.load(targets_ptr + pid).to(tl.int64)
    ignored = target == ignore_index
    valid = (target >= 0) & (target < n_cols)
    x_t = tl.load(row + tl.where(valid, target, 0)).to(tl.float32)
    loss = tl.where(valid, lse - x_t, float("nan"))
    tl.store(losses_ptr + pid, tl.where(ignored, 0.0, loss))

    if SCALE_FROM_PTR:
        scale = tl.load(scale_ptr).to(tl.float32)
    else:
        scale = scale_value
    # an ignored row's gradient is 0; a bad target's is NaN (like its loss)
    scale = tl.where(ignored, 0.0, tl.where(valid, scale, float("nan")))
    # pass 2: overwrite the row with its gradient, in the logits' dtype (the logits are never needed again)
    store_row_gradient(row, row, n_cols, lse, target, scale, BLOCK_SIZE, NUM_STAGES)


# --------------------------------------------------------------------------- launcher


def check(logits, targets, what: str = "fused_classifier") -> None:
    """The cross-entropy kernels' checks (:func:`course_utils.kernels.cross_entropy.check`), and contiguous targets."""
    check_logits(logits, targets, what)
    if targets.numel() and not targets.is_contiguous():
        raise ValueError(f"{what}: targets must be contiguous, got stride {targets.stride()}")


def block_size(n_cols: int) -> int:
    return min(MAX_BLOCK, triton.next_power_of_2(n_cols))


def mean_scale(targets: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """1 / (number of rows whose target is not ``ignore_index``), a float32 device tensor (no host sync;
    inf when every row is ignored, and then the mean loss is 0 * inf = NaN, as F.cross_entropy's)."""
    return 1.0 / (targets != ignore_index).sum(dtype=torch.float32)


def fused_classifier_teaching(logits, targets, scale=None, *, ignore_index: int = IGNORE_INDEX, losses=None,
                              block: int | None = None, num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """v2: each row's float32 loss; **the logits are overwritten** with d(sum of loss * scale)/d(logits).

    ``scale``: a Python float, a one-element tensor on the logits' device, or None for
    :func:`mean_scale` (the mean over the rows not ignored). The mean loss is ``losses.sum() * scale``.
    ``losses``: where to write the per-row losses (contiguous float32 of shape (rows,)), or None for a new tensor.
    """
    check(logits, targets)
    n_rows, n_cols = logits.shape
    if scale is None:
        scale = mean_scale(targets, ignore_index)
    from_ptr = isinstance(scale, torch.Tensor)
    if from_ptr and (scale.numel() != 1 or scale.device != logits.device or not scale.is_floating_point()):
        raise ValueError(f"fused_classifier: a tensor scale must be one floating element on {logits.device}, "
                         f"got {scale.dtype} of shape {tuple(scale.shape)} on {scale.device}")
    if losses is None:
        losses = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    elif losses.shape != (n_rows,) or losses.dtype != torch.float32 or losses.device != logits.device \
            or not losses.is_contiguous():
        raise ValueError(f"fused_classifier: losses must be contiguous float32 of shape ({n_rows},) on "
                         f"{logits.device}, got {losses.dtype} of shape {tuple(losses.shape)} on {losses.device}")
    if n_rows:
        fused_classifier_kernel[(n_rows,)](
            logits, losses, targets, scale if from_ptr else losses, 0.0 if from_ptr else float(scale), n_cols,
            logits.stride(0), int(ignore_index), SCALE_FROM_PTR=from_ptr, BLOCK_SIZE=block or block_size(n_cols),
            NUM_STAGES=num_stages, num_warps=num_warps)
    return losses


def fused_classifier_ref(logits, targets, scale=None, *, ignore_index: int = IGNORE_INDEX):
    """v1: (losses, dlogits) in float64, the same contract as :func:`fused_classifier_teaching` (nothing in place)."""
    x = logits.detach().double().requires_grad_(True)
    t = targets.long()
    ignored = t == ignore_index
    safe = torch.where(ignored, 0, t)
    lse = torch.logsumexp(x, dim=1)
    if x.shape[0]:
        picked = x.gather(1, safe.clamp(0, x.shape[1] - 1)[:, None])[:, 0]
    else:
        picked = lse
    bad = ~ignored & ((t < 0) | (t >= x.shape[1]))
    losses = torch.where(ignored, 0.0, torch.where(bad, float("nan"), lse - picked))
    if scale is None:
        scale = 1.0 / (~ignored).sum().double()
    scale = torch.as_tensor(scale, dtype=torch.float64, device=x.device)
    (grad,) = torch.autograd.grad((torch.where(bad, 0.0, losses) * scale).sum(), x) if x.shape[0] else (x * 0,)
    grad = torch.where(bad[:, None], float("nan"), grad)
    return losses.detach(), grad


def compile_cases(info):
    """The launches the compile matrix compiles for ``info`` (course_utils/aot.py): a chunk of GPT-2's
    vocabulary as the tuned path launches it (8 warps, scale on the device), the byte vocabulary, a float
    scale, both dtypes of targets."""
    from ..aot import dtype_name, dtypes_for, empty
    for dt in dtypes_for(info):
        for rows, vocab, warps in ((2048, 50304, 8), (8192, 256, 4)):
            logits, scale = empty(rows, vocab, dtype=dt), empty(())
            for tdt in (torch.int64, torch.int32):
                targets = empty(rows, dtype=tdt)
                label = f"fused_classifier {dtype_name(dt)} {rows}x{vocab} targets {dtype_name(tdt)} {warps} warps"
                yield f"{label}, device scale", lambda lg=logits, t=targets, s=scale, w=warps: \
                    fused_classifier_teaching(lg, t, s, num_warps=w)
                yield f"{label}, float scale", lambda lg=logits, t=targets, w=warps: \
                    fused_classifier_teaching(lg, t, 0.5, num_warps=w)
