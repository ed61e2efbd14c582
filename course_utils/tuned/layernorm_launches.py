"""The tuned LayerNorm/RMSNorm backward's launches (chapter 10), apart from the plans that choose them
(:mod:`.layernorm_plans`) and the shelf's ops (:mod:`.layernorm`, which re-exports these names).

:func:`backward_launch` works out, once per plan and width, everything a launch needs besides the tensors
(kernel, grid, meta-parameters, the partial buffers' rows, the int arguments after the strides): the ops keep it
per shape, so a call pays only for its allocations and the launch (chapter 12: host time is speed).
:func:`_launch_backward` is the shelf's path, atomic sums included.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton

from .launch import launch
from .layernorm_kernels import (
    norm_bwd_chunked_kernel,
    norm_bwd_kernel,
    norm_bwd_mix_kernel,
    norm_bwd_row_kernel,
    norm_bwd_split_kernel,
)
from .layernorm_plans import Plan


class BackwardLaunch(NamedTuple):
    """What a plan's backward launch needs besides the tensors, worked out once per plan (the ops keep it per
    shape: chapter 12's host cost): the kernel, its grid and meta-parameters, the rows of the float32 partial
    buffers, the int arguments after the strides, and whether the kernel also takes the atomic outputs."""

    kernel: object
    name: str
    grid: tuple
    meta: dict
    partial_rows: int
    tail: tuple
    chunked: bool


def backward_launch(p: Plan, n_cols: int, rms: bool, atomic: bool = False) -> BackwardLaunch:
    """The :class:`BackwardLaunch` of plan ``p`` for rows of ``n_cols`` columns."""
    if p.version == "chunked":
        return BackwardLaunch(norm_bwd_chunked_kernel, "norm_bwd_chunked", (p.grid,),
                              dict(CHUNK=p.BLOCK_N, RMS=rms, ATOMIC=atomic, num_warps=p.num_warps), p.grid,
                              (p.rows_per_program,), True)
    if p.version == "split":
        slices = triton.cdiv(n_cols, p.BLOCK_N)
        if p.grid % slices:
            raise ValueError(f"a split plan needs a grid of whole runs of {slices} slices, got {p.grid} programs")
        return BackwardLaunch(norm_bwd_split_kernel, "norm_bwd_split", (p.grid,),
                              dict(SLICE=p.BLOCK_N, CHUNK=p.chunk or p.BLOCK_N, RMS=rms, ATOMIC=atomic,
                                   num_warps=p.num_warps), p.grid // slices, (p.rows_per_program, slices), False)
    stages = dict(STAGES=p.stages or None, num_warps=p.num_warps)
    if p.version == "mix":
        return BackwardLaunch(norm_bwd_mix_kernel, "norm_bwd_mix", (p.grid,),
                              dict(BLOCK_N=p.BLOCK_N, RMS=rms, ATOMIC=atomic, EVEN=n_cols == p.BLOCK_N, **stages),
                              p.grid, (p.rows_per_program,), False)
    if p.version == "row":
        return BackwardLaunch(norm_bwd_row_kernel, "norm_bwd_row", (p.grid,),
                              dict(BLOCK_N=p.BLOCK_N, RMS=rms, ATOMIC=atomic, **stages), p.grid,
                              (p.rows_per_program,), False)
    return BackwardLaunch(norm_bwd_kernel, "norm_bwd", (p.grid,),
                          dict(BLOCK_N=p.BLOCK_N, ROWS=p.ROWS, RMS=rms, ATOMIC=atomic, **stages), p.grid,
                          (p.rows_per_program,), False)


def launch_backward(s: BackwardLaunch, dx, dy, x, weight, mean, rstd, n_rows: int, n_cols: int, x_stride: int,
                    dy_stride: int):
    """One backward launch of ``s`` into fresh float32 partial rows (dw, db) (db is dw for RMSNorm: ``mean``
    None); dx contiguous, x and dy rows of unit column stride at ``x_stride``/``dy_stride``."""
    # (empty_strided and empty_like: the cheap allocations from Python, course_utils.ops._lib says why)
    dw = torch.empty_strided((s.partial_rows, n_cols), (n_cols, 1), dtype=torch.float32, device=x.device)
    db = dw if mean is None else torch.empty_like(dw)
    outs = (dw, db, dw, db) if s.chunked else (dw, db)
    launch(s.kernel, s.name, s.grid, (dx, dy, x, weight, rstd if mean is None else mean, rstd, *outs, n_rows,
                                      n_cols, x_stride, dy_stride, n_cols, *s.tail), s.meta)
    return dw, None if mean is None else db


def _launch_backward(p: Plan, dx, dy2, x2, weight, mean, rstd, rms: bool, atomic: bool):
    """One backward launch of plan ``p``; returns (dw, db) in float32 (db is None for RMSNorm): the partial rows,
    or with ``atomic`` one zeroed row each that every program adds its sums into."""
    n_rows, n_cols = x2.shape
    s = backward_launch(p, n_cols, rms, atomic)
    if not atomic:
        return launch_backward(s, dx, dy2, x2, weight, None if rms else mean, rstd, n_rows, n_cols, x2.stride(0),
                               dy2.stride(0))
    dw = torch.zeros(n_cols, dtype=torch.float32, device=x2.device)
    db = dw if rms else torch.zeros_like(dw)
    outs = (dw, db)
    if s.chunked:   # the chunked kernel also takes partial rows, written before the atomic adds
        partial = torch.empty((s.partial_rows, n_cols), dtype=torch.float32, device=x2.device)
        outs = (partial, partial if rms else torch.empty_like(partial), dw, db)
    launch(s.kernel, s.name, s.grid, (dx, dy2, x2, weight, rstd if rms else mean, rstd, *outs, n_rows, n_cols,
                                      x2.stride(0), dy2.stride(0), dx.stride(0), *s.tail), s.meta)
    return dw, None if rms else db
