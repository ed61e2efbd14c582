"""The chapter 10 checkers pass the right kernels and fail the usual wrong ones, naming the fault."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from course_utils import check
from course_utils.checkers import layernorm as checks
from course_utils.kernels import layernorm as L

# ----------------------------------------------------------------------------- forward row kernels
# MODE selects the mistake (a constexpr, so each wrong kernel is one short branch of the same code):
# 0 right, 1 variance without the mean subtracted, 2 one-pass variance E[x^2] - E[x]^2,
# 3 statistics in 16 bits (float16: the interpreter's bfloat16 arithmetic is wrong, so float16 stands in
# for the "statistics in bf16" mistake; on a GPU the bf16 version fails the same way), 4 padded lanes
# in the variance, 5 mean divided by BLOCK_SIZE, 6 rows found with n_cols instead of the stride.


@triton.jit
def _forward(y_ptr, x_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, n_cols, x_row_stride, y_row_stride, eps,
             BLOCK_SIZE: tl.constexpr, MODE: tl.constexpr):
    pid = tl.program_id(0)
    offsets = tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_cols
    stride = n_cols if MODE == 6 else x_row_stride
    x = tl.load(x_ptr + pid * stride + offsets, mask=mask, other=0.0)
    if MODE == 3:
        x = x.to(tl.float16)
    else:
        x = x.to(tl.float32)
    if MODE == 5:
        mean = tl.sum(x, axis=0) / BLOCK_SIZE
    else:
        mean = tl.sum(x, axis=0) / n_cols
    xc = tl.where(mask, x - mean, 0.0)
    if MODE == 1:
        var = tl.sum(x * x, axis=0) / n_cols
    elif MODE == 2:
        var = tl.sum(x * x, axis=0) / n_cols - mean * mean
    elif MODE == 4:
        var = tl.sum((x - mean) * (x - mean), axis=0) / n_cols
    else:
        var = tl.sum(xc * xc, axis=0) / n_cols
    rstd = 1.0 / tl.sqrt(var.to(tl.float32) + eps)
    w = tl.load(w_ptr + offsets, mask=mask).to(tl.float32)
    b = tl.load(b_ptr + offsets, mask=mask).to(tl.float32)
    y = (x - mean).to(tl.float32) * rstd * w + b
    tl.store(y_ptr + pid * y_row_stride + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + pid, mean.to(tl.float32))
    tl.store(rstd_ptr + pid, rstd)


def _mode(mode):
    def kernel_like(grid):
        def launch(*args, **kwargs):
            return _forward[grid](*args, **kwargs, MODE=mode)
        return launch

    class K:
        def __getitem__(self, grid):
            return kernel_like(grid)
    return K()


def test_teaching_forward_kernel_passes(capsys):
    checks.check_forward_kernel(L.layer_norm_fwd_kernel)
    assert capsys.readouterr().out.startswith("PASS LayerNorm forward")


def test_mode_zero_of_the_wrong_kernels_is_right():
    checks.check_forward_kernel(_mode(0))


@pytest.mark.parametrize("mode, words", [
    (1, "without subtracting the mean"),
    (2, "one-pass variance"),
    (3, "16 bits"),
    (4, "masked lanes"),
    (5, "BLOCK_SIZE"),
])
def test_wrong_forward_kernels_fail_naming_the_fault(mode, words):
    with pytest.raises(check.CheckFailure, match=words):
        checks.check_forward_kernel(_mode(mode))


def test_wrong_row_stride_fails():
    with pytest.raises(check.CheckFailure):
        checks.check_forward_kernel(_mode(6))


def _student_layer_norm(x, w, b, eps):
    """A launcher as a student writes it, around the right kernel of this file."""
    n_rows, n_cols = x.shape
    y = torch.empty_like(x)
    mean = torch.empty(n_rows, device=x.device, dtype=torch.float32)
    rstd = torch.empty_like(mean)
    _forward[(n_rows,)](y, x, w, b, mean, rstd, n_cols, x.stride(0), y.stride(0), eps,
                        BLOCK_SIZE=triton.next_power_of_2(n_cols), MODE=0)
    return y


def test_launcher_check_counts_one_launch(capsys):
    checks.check_layer_norm_fn(_student_layer_norm)
    assert "one kernel launch" in capsys.readouterr().out
    with pytest.raises(check.CheckFailure, match="the work ran in torch"):
        checks.check_layer_norm_fn(lambda x, w, b, eps: _student_layer_norm(x, w, b, eps) * 1.0)
    with pytest.raises(check.CheckFailure, match="differ"):
        checks.check_layer_norm_fn(lambda x, w, b, eps: _student_layer_norm(x, w, b * 0, eps))
    with pytest.raises(check.CheckFailure, match="course's own kernel"):
        checks.check_layer_norm_fn(lambda x, w, b, eps: L.layer_norm_teaching(x, w, b, eps))


def test_untouched_exercise_raises_not_implemented():
    def stub(*args, **kwargs):
        raise NotImplementedError("Exercise 10.1")

    class K:
        def __getitem__(self, grid):
            return stub
    with pytest.raises(NotImplementedError):
        checks.check_forward_kernel(K())
    with pytest.raises(NotImplementedError):
        checks.check_dw_db_kernel(K())

# ----------------------------------------------------------------------------- dw/db reduction
# MODE: 0 right, 1 wrong axis (tl.sum over axis 1), 2 every program sums every row, 3 no column mask
# on the store, 4 x_hat without the mean subtracted.


@triton.jit
def _dw_db(dw_partial_ptr, db_partial_ptr, x_ptr, dy_ptr, mean_ptr, rstd_ptr, n_rows, n_cols, x_row_stride,
           dy_row_stride, rows_per_program, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr):
    pid_m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    first = 0 if MODE == 2 else pid_m * rows_per_program
    end = n_rows if MODE == 2 else tl.minimum(first + rows_per_program, n_rows)
    start = first
    while start < end:
        rows = start + tl.arange(0, BLOCK_M)
        row_mask = rows < end
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows[:, None] * dy_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        if MODE == 4:
            x_hat = x * rstd[:, None]
        else:
            x_hat = (x - mean[:, None]) * rstd[:, None]
        if MODE == 1:
            dw += tl.sum(dy * x_hat, axis=1)
            db += tl.sum(dy, axis=1)
        else:
            dw += tl.sum(dy * x_hat, axis=0)
            db += tl.sum(dy, axis=0)
        start += BLOCK_M
    store_mask = cols < BLOCK_N * tl.num_programs(1) if MODE == 3 else col_mask
    tl.store(dw_partial_ptr + pid_m * n_cols + cols, dw, mask=store_mask)
    tl.store(db_partial_ptr + pid_m * n_cols + cols, db, mask=store_mask)


def _dw_mode(mode):
    class K:
        def __getitem__(self, grid):
            return lambda *a, **k: _dw_db[grid](*a, **k, MODE=mode)
    return K()


def test_teaching_dw_db_kernel_passes(capsys):
    checks.check_dw_db_kernel(L.norm_dw_db_kernel)
    assert capsys.readouterr().out.startswith("PASS dw/db reduction")
    checks.check_dw_db_kernel(_dw_mode(0))


@pytest.mark.parametrize("mode, words", [
    (1, "wrong axis"),
    (2, "ITS rows"),
    (3, "outside its buffer"),
    (4, "differ"),
])
def test_wrong_dw_db_kernels_fail_naming_the_fault(mode, words):
    with pytest.raises(check.CheckFailure, match=words):
        checks.check_dw_db_kernel(_dw_mode(mode))


def test_fresh_inputs_every_call():
    a = checks._inputs(3, 10, torch.float32)[1].clone()
    b = checks._inputs(3, 10, torch.float32)[1].clone()
    assert not torch.equal(a, b)
    assert float(a[0].mean()) > 900 and abs(float(a[1].mean())) < 100  # even rows sit on the offset
