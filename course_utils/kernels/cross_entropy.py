"""Cross-entropy loss from logits, forward and backward (chapter 12): chapter 6's online softmax
applied to the loss, so the (rows x vocab) probabilities are never written.

``loss = mean over rows of (logsumexp(logits[r]) - logits[r, target[r]])``.

v1  ``cross_entropy_ref``: ``F.cross_entropy`` on float32 logits (log_softmax, then gather and mean:
    the log-probabilities make a round trip through HBM, and the backward reads them back).
v2  ``cross_entropy_fwd_kernel``: one program per row walks the vocabulary in tiles of BLOCK_SIZE with
    a running max and sum per lane (chapter 6's recurrence), combines the lanes, and writes the row's
    loss and its logsumexp (4 bytes each). The mean over rows is one small reduction after it.
    ``cross_entropy_bwd_kernel``: one program per row reads the logits once more and writes
    ``dlogits = (softmax - onehot(target)) * dloss / n_rows``, softmax = exp(logits - lse) from the
    saved logsumexp; ``dloss`` is read from device memory (no host sync; a CUDA graph replays it).

A target outside [0, vocab) gives a NaN loss for its row (checking it on the host would cost a sync).
Launchers: ``cross_entropy_teaching`` (returns loss, lse) and ``cross_entropy_backward_teaching``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_BLOCK = 4096   # vocabulary tile: a row of GPT-2's 50257 logits is 13 tiles


@triton.jit
def row_logsumexp(row, n_cols, BLOCK_SIZE: tl.constexpr, NUM_STAGES: tl.constexpr):
    """logsumexp of one row in tiles of BLOCK_SIZE: a running max m and sum s = sum exp(x - m) per lane
    (chapter 6's recurrence), combined across the lanes at the end."""
    offsets = tl.arange(0, BLOCK_SIZE)
    m = tl.full((BLOCK_SIZE,), -float("inf"), tl.float32)
    s = tl.zeros((BLOCK_SIZE,), tl.float32)
    for start in tl.range(0, n_cols, BLOCK_SIZE, num_stages=NUM_STAGES):
        cols = start + offsets
        x = tl.load(row + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        m_use = tl.where(m_new == -float("inf"), 0.0, m_new)  # nothing finite yet in this lane: s stays 0
        s = s * tl.exp(m - m_use) + tl.exp(x - m_use)
        m = m_new
    row_max = tl.max(m, axis=0)
    total = tl.sum(s * tl.exp(m - row_max), axis=0)  # lanes that saw nothing: 0 * exp(-inf) = 0
    return row_max + tl.log(total)


@triton.jit
def store_row_gradient(d_row, row, n_cols, lse, target, scale, BLOCK_SIZE: tl.constexpr, NUM_STAGES: tl.constexpr):
    """d_row = (exp(row - lse) - onehot(target)) * scale, in d_row's dtype (d_row may be row itself)."""
    offsets = tl.arange(0, BLOCK_SIZE)
    for start in tl.range(0, n_cols, BLOCK_SIZE, num_stages=NUM_STAGES):
        cols = start + offsets
        mask = cols < n_cols
        x = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
        d = tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)
        tl.store(d_row + cols, (d * scale).to(d_row.dtype.element_ty), mask=mask)


@triton.jit
def cross_entropy_fwd_kernel(loss_ptr, lse_ptr, logits_ptr, targets_ptr, n_cols, row_stride,
                             BLOCK_SIZE: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Row ``pid``: lse = logsumexp(logits), loss = lse - logits[target]."""
    pid = tl.program_id(0)
    row = logits_ptr + pid.to(tl.int64) * row_stride
    lse = row_logsumexp(row, n_cols, BLOCK_SIZE, NUM_STAGES)
    target = tl.load(targets_ptr + pid).to(tl.int64)
    valid = (target >= 0) & (target < n_cols)
    x_t = tl.load(row + tl.where(valid, target, 0)).to(tl.float32)
    tl.store(loss_ptr + pid, tl.where(valid, lse - x_t, float("nan")))
    tl.store(lse_ptr + pid, lse)


@triton.jit
def cross_entropy_bwd_kernel(dlogits_ptr, logits_ptr, targets_ptr, lse_ptr, dloss_ptr, n_cols, row_stride,
                             d_row_stride, inv_n_rows, BLOCK_SIZE: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Row ``pid``: dlogits = (exp(logits - lse) - onehot(target)) * dloss / n_rows."""
    # torch.compile passes floats as fp64: keep the math in float32 (tl.cast: the interpreter passes a Python float)
    inv_n_rows = tl.cast(inv_n_rows, tl.float32)
    pid = tl.program_id(0)
    row = logits_ptr + pid.to(tl.int64) * row_stride
    d_row = dlogits_ptr + pid.to(tl.int64) * d_row_stride
    lse = tl.load(lse_ptr + pid)
    target = tl.load(targets_ptr + pid).to(tl.int64)
    scale = tl.load(dloss_ptr).to(tl.float32) * inv_n_rows
    store_row_gradient(d_row, row, n_cols, lse, target, scale, BLOCK_SIZE, NUM_STAGES)


# --------------------------------------------------------------------------- launchers


def check(logits, targets, what: str = "cross_entropy") -> None:
    if not isinstance(logits, torch.Tensor) or not isinstance(targets, torch.Tensor):
        raise TypeError(f"{what}: logits and targets must be torch.Tensors")
    if logits.dim() != 2:
        raise ValueError(f"{what}: logits must be 2-D (rows, vocab), got shape {tuple(logits.shape)} "
                         "(flatten the leading dims: logits.view(-1, vocab))")
    if logits.dtype not in DTYPES:
        raise TypeError(f"{what}: logits must be float32, float16 or bfloat16, got {logits.dtype}")
    if targets.shape != logits.shape[:1] or targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{what}: targets must be int64 or int32 of shape ({logits.shape[0]},), got "
                         f"{targets.dtype} of shape {tuple(targets.shape)}")
    if targets.device != logits.device:
        raise ValueError(f"{what}: targets are on {targets.device} but logits on {logits.device}")
    if logits.shape[1] == 0:
        raise ValueError(f"{what}: the vocabulary is empty (logits has 0 columns)")
    if logits.stride(1) != 1 and logits.shape[1] > 1:
        raise ValueError(f"{what}: logits must have unit stride along the vocabulary, got strides "
                         f"{logits.stride()}")


def block_size(n_cols: int) -> int:
    return min(MAX_BLOCK, triton.next_power_of_2(n_cols))


def cross_entropy_teaching(logits, targets, *, block: int | None = None, num_warps: int = 4,
                           num_stages: int = 2):
    """v2: (loss, lse): the float32 mean loss (a 0-d tensor) and each row's float32 logsumexp."""
    check(logits, targets)
    n_rows, n_cols = logits.shape
    losses = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(losses)
    if n_rows == 0:
        return losses.sum() / 0.0, lse   # the mean of no rows: NaN, as F.cross_entropy
    cross_entropy_fwd_kernel[(n_rows,)](losses, lse, logits, targets, n_cols, logits.stride(0),
                                        BLOCK_SIZE=block or block_size(n_cols), NUM_STAGES=num_stages,
                                        num_warps=num_warps)
    return losses.mean(), lse


def cross_entropy_backward_teaching(dloss, logits, targets, lse, *, block: int | None = None, num_warps: int = 4,
                                    num_stages: int = 2):
    """v2: dlogits (contiguous, logits' dtype) of the mean loss, from the saved ``lse``; ``dloss`` is a
    one-element tensor on the logits' device."""
    check(logits, targets, "cross_entropy backward")
    n_rows, n_cols = logits.shape
    if not isinstance(dloss, torch.Tensor) or dloss.numel() != 1 or dloss.device != logits.device:
        raise ValueError(f"cross_entropy backward: dloss must be a one-element tensor on {logits.device}")
    dlogits = torch.empty((n_rows, n_cols), dtype=logits.dtype, device=logits.device)
    if n_rows:
        cross_entropy_bwd_kernel[(n_rows,)](dlogits, logits, targets, lse, dloss, n_cols, logits.stride(0),
                                            n_cols, 1.0 / n_rows, BLOCK_SIZE=block or block_size(n_cols),
                                            NUM_STAGES=num_stages, num_warps=num_warps)
    return dlogits


def cross_entropy_ref(logits, targets):
    """v1: the eager loss in float32 (float64 logits stay float64)."""
    x = logits if logits.dtype == torch.float64 else logits.float()
    return F.cross_entropy(x, targets.long())


def compile_cases(info):
    """The launches the compile matrix compiles for ``info`` (course_utils/aot.py): GPT's byte vocabulary,
    GPT-2's 50257 (13 tiles), both dtypes of targets."""
    from ..aot import dtype_name, dtypes_for, empty
    for dt in dtypes_for(info):
        for rows, vocab in ((8192, 256), (64, 50257)):
            logits, lse, dloss = empty(rows, vocab, dtype=dt), empty(rows), empty(())
            for tdt in (torch.int64, torch.int32):
                targets = empty(rows, dtype=tdt)
                label = f"{dtype_name(dt)} {rows}x{vocab} targets {dtype_name(tdt)}"
                yield f"cross_entropy {label}", lambda lg=logits, t=targets: cross_entropy_teaching(lg, t)
                yield (f"cross_entropy backward {label}", lambda lg=logits, t=targets, lse=lse, d=dloss:
                       cross_entropy_backward_teaching(d, lg, t, lse))
