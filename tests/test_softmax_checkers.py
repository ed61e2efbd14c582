"""The chapter 5-6 checkers pass the right answers and fail the usual wrong ones."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from course_utils import check
from course_utils.checkers import softmax as checks
from course_utils.kernels import softmax as sm

# ----------------------------------------------------------------------------- row kernels


@triton.jit
def _no_load_mask(y_ptr, x_ptr, n_cols, x_row_stride, y_row_stride, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(0)
    offsets = tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_cols
    x = tl.load(x_ptr + pid * x_row_stride + offsets).to(tl.float32)   # reads past the row
    x = x - tl.max(x, axis=0)
    e = tl.exp(x)
    tl.store(y_ptr + pid * y_row_stride + offsets, (e / tl.sum(e, axis=0)).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _zero_padding(y_ptr, x_ptr, n_cols, x_row_stride, y_row_stride, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(0)
    offsets = tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_cols
    x = tl.load(x_ptr + pid * x_row_stride + offsets, mask=mask, other=0.0).to(tl.float32)
    x = x - tl.max(x, axis=0)
    e = tl.exp(x)
    tl.store(y_ptr + pid * y_row_stride + offsets, (e / tl.sum(e, axis=0)).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _unstable_exp(y_ptr, x_ptr, n_cols, x_row_stride, y_row_stride, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(0)
    offsets = tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_cols
    x = tl.load(x_ptr + pid * x_row_stride + offsets, mask=mask, other=-float("inf")).to(tl.float32)
    e = tl.exp(x)                                                          # no max subtracted
    tl.store(y_ptr + pid * y_row_stride + offsets, (e / tl.sum(e, axis=0)).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _wrong_stride(y_ptr, x_ptr, n_cols, x_row_stride, y_row_stride, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(0)
    offsets = tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_cols
    x = tl.load(x_ptr + pid * n_cols + offsets, mask=mask, other=-float("inf")).to(tl.float32)  # n_cols, not stride
    x = x - tl.max(x, axis=0)
    e = tl.exp(x)
    tl.store(y_ptr + pid * y_row_stride + offsets, (e / tl.sum(e, axis=0)).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _no_store_mask(y_ptr, x_ptr, n_cols, x_row_stride, y_row_stride, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(0)
    offsets = tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_cols
    x = tl.load(x_ptr + pid * x_row_stride + offsets, mask=mask, other=-float("inf")).to(tl.float32)
    x = x - tl.max(x, axis=0)
    e = tl.exp(x)
    tl.store(y_ptr + pid * y_row_stride + offsets, (e / tl.sum(e, axis=0)).to(y_ptr.dtype.element_ty))


@triton.jit
def _first_tile_only(y_ptr, x_ptr, n_cols, x_row_stride, y_row_stride, BLOCK_SIZE: tl.constexpr):
    # A "long-row" kernel that forgets to loop: right only when the row fits in one tile.
    pid = tl.program_id(0)
    offsets = tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_cols
    x = tl.load(x_ptr + pid * x_row_stride + offsets, mask=mask, other=-float("inf")).to(tl.float32)
    x = x - tl.max(x, axis=0)
    e = tl.exp(x)
    tl.store(y_ptr + pid * y_row_stride + offsets, (e / tl.sum(e, axis=0)).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _no_correction(y_ptr, x_ptr, n_cols, x_row_stride, y_row_stride, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(0)
    offsets = tl.arange(0, BLOCK_SIZE)
    m = -float("inf")
    s = 0.0
    start = 0
    while start < n_cols:
        cols = start + offsets
        x = tl.load(x_ptr + pid * x_row_stride + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s + tl.sum(tl.exp(x - m_new), axis=0)      # the old sum is not rescaled
        m = m_new
        start += BLOCK_SIZE
    start = 0
    while start < n_cols:
        cols = start + offsets
        mask = cols < n_cols
        x = tl.load(x_ptr + pid * x_row_stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
        tl.store(y_ptr + pid * y_row_stride + cols, (tl.exp(x - m) / s).to(y_ptr.dtype.element_ty), mask=mask)
        start += BLOCK_SIZE


@triton.jit
def _nan_on_minus_inf(y_ptr, x_ptr, n_cols, x_row_stride, y_row_stride, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(0)
    offsets = tl.arange(0, BLOCK_SIZE)
    m = -float("inf")
    s = 0.0
    start = 0
    while start < n_cols:
        cols = start + offsets
        x = tl.load(x_ptr + pid * x_row_stride + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)   # NaN while m_new is -inf
        m = m_new
        start += BLOCK_SIZE
    start = 0
    while start < n_cols:
        cols = start + offsets
        mask = cols < n_cols
        x = tl.load(x_ptr + pid * x_row_stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
        tl.store(y_ptr + pid * y_row_stride + cols, (tl.exp(x - m) / s).to(y_ptr.dtype.element_ty), mask=mask)
        start += BLOCK_SIZE


def test_row_checker_passes_the_course_kernel(capsys):
    checks.check_row_kernel(sm._softmax_row_kernel)
    assert capsys.readouterr().out.startswith("PASS fused softmax")


@pytest.mark.parametrize("kernel, words", [
    (_no_load_mask, "differ"),
    (_zero_padding, "differ"),
    (_unstable_exp, "NaN"),
    (_wrong_stride, "differ"),
    (_no_store_mask, "outside its buffer"),
])
def test_row_checker_fails_wrong_kernels(kernel, words):
    with pytest.raises(check.CheckFailure, match=words):
        checks.check_row_kernel(kernel)


def test_row_checker_reports_a_crash():
    @triton.jit
    def _crash(y_ptr, x_ptr, n_cols, x_row_stride, y_row_stride, BLOCK_SIZE: tl.constexpr):
        raise NotImplementedError("Exercise 5.1")

    with pytest.raises((check.CheckFailure, NotImplementedError)):
        checks.check_row_kernel(_crash)


def test_long_row_checker_passes_the_course_kernel(capsys):
    checks.check_long_row_kernel(sm._softmax_online_kernel)
    assert "PASS online softmax, long rows" in capsys.readouterr().out


@pytest.mark.parametrize("kernel", [_first_tile_only, _no_correction, _nan_on_minus_inf])
def test_long_row_checker_fails_wrong_kernels(kernel):
    with pytest.raises(check.CheckFailure):
        checks.check_long_row_kernel(kernel)


# ----------------------------------------------------------------------------- update rule


def _good_update(m, s, tile):
    m_new = torch.maximum(m, tile.amax(-1))
    safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
    return m_new, s * torch.exp(m - safe) + torch.exp(tile - safe[:, None]).sum(-1)


def test_update_checker_passes_the_rule(capsys):
    checks.check_online_update(_good_update)
    assert capsys.readouterr().out.startswith("PASS online softmax update")


@pytest.mark.parametrize("update", [
    lambda m, s, t: (torch.maximum(m, t.amax(-1)), s + torch.exp(t - torch.maximum(m, t.amax(-1))[:, None]).sum(-1)),
    lambda m, s, t: (torch.maximum(m, t.amax(-1)), s * torch.exp(m - torch.maximum(m, t.amax(-1)))
                     + torch.exp(t - torch.maximum(m, t.amax(-1))[:, None]).sum(-1)),          # NaN on -inf tiles
    lambda m, s, t: (torch.maximum(m, t.amax(-1)), s + torch.exp(t).sum(-1)),                   # no max at all
    lambda m, s, t: _good_update(m, s, t)[0],                                                   # wrong return
])
def test_update_checker_fails_wrong_rules(update):
    with pytest.raises(check.CheckFailure):
        checks.check_online_update(update)


def test_update_checker_lets_not_implemented_through():
    def stub(m, s, t):
        raise NotImplementedError("Exercise 6.1")

    with pytest.raises(NotImplementedError):
        checks.check_online_update(stub)
