"""Chapter 11's bias + GELU backward on a hot path (``course::linear_gelu``'s backward, once per MLP a step).

The kernel is the teaching one (:mod:`course_utils.kernels.gelu_backward`: dx and one partial column sum
per tile, the partial sums then added by torch); what changes is the host's work per call. The first
call of a (shapes, strides, dtypes, devices) key is ``bias_gelu_backward_teaching`` itself, with all of
its checks; a later call of that key allocates dx and the partial sums and launches the same kernel,
with the same arguments, through the ops' cheaper launch (:mod:`.launch`).
"""

from __future__ import annotations

import torch

from ..kernels.gelu_backward import bias_gelu_backward_kernel, bias_gelu_backward_teaching
from ..kernels.layouts import NO_LAYOUT
from .launch import launch, traced

BLOCK_M, BLOCK_N = 32, 64   # the teaching launcher's defaults
_META = dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, APPROXIMATE=True, DROPOUT=False, STRIDED=False)   # never mutated
_PLANS: dict = {}


def _plan(x: torch.Tensor) -> tuple:
    """(grid, n_rows, n_cols, the partial sums' size and strides) of the teaching launcher's tiles over the
    contiguous x (the size and strides as ints: empty_strided parses them cheapest, ``course_utils.ops._lib``)."""
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols
    grid = (-(-n_rows // BLOCK_M), -(-n_cols // BLOCK_N))
    return grid, n_rows, n_cols, (grid[0], n_cols), (n_cols, 1)


def bias_gelu_backward(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, db)`` of ``y = gelu_tanh(x + bias)`` (no dropout) from ``dy``: the bits of
    ``bias_gelu_backward_teaching(dy, x, bias)``, for contiguous or any dense x and dy of one layout."""
    key = (x.shape, x.stride(), dy.stride(), x.dtype, dy.dtype, bias.shape, bias.stride(), bias.dtype, x.device,
           dy.device, bias.device)
    plan = _PLANS.get(key)
    if plan is None and traced(x) and x.numel() and x.is_contiguous():   # torch.compile traces: no plain launch
        plan = _plan(x)
    if plan is None:
        dx, db = bias_gelu_backward_teaching(dy, x, bias, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
        if x.numel() and x.is_contiguous():
            if len(_PLANS) >= 4096:   # many distinct layouts (a sweep): start over rather than grow
                _PLANS.clear()
            _PLANS[key] = _plan(x)
        return dx, db
    grid, n_rows, n_cols, partial_size, partial_strides = plan
    dx = torch.empty_like(x)
    partial = torch.empty_strided(partial_size, partial_strides, dtype=torch.float32, device=x.device)
    launch(bias_gelu_backward_kernel, "bias_gelu_backward", grid,
           (dy, x, bias, dx, partial, n_rows, n_cols, 0.0, 1.0, 0, *NO_LAYOUT), _META)
    return dx, _column_sum(partial, bias.dtype)


def _column_sum(partial: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The teaching launcher's second reduction, ``partial.sum(dim=0).to(dtype)``, in its cheapest spelling:
    ``torch.sum(partial, 0)`` parses its arguments faster than the method with ``dim=`` (2.1 vs 2.4 us on a
    CPU), and ``.to`` is skipped where it would return the sum itself (~1 us). Not ``torch.sum(partial, 0,
    dtype=dtype)``: that casts each partial sum to dtype before adding (other bits for bfloat16 and float16)."""
    db = torch.sum(partial, 0)
    return db if dtype is torch.float32 else db.to(dtype)
