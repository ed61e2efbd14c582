"""The chapter 10 checkers pass the right kernels and fail the usual wrong ones, naming the fault."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import course_utils as cu
from course_utils import check
from course_utils.checkers import layernorm as checks
from course_utils.kernels import layernorm as L
from course_utils.tuned import layernorm as T
from course_utils.tuned import layernorm_kernels as TK

# a load outside the inputs is seen under the interpreter only (on a GPU it reads the guard zone unseen)
INTERPRETER_ONLY = pytest.mark.skipif(cu.on_gpu(), reason="loads are inspected under the interpreter only")

# ----------------------------------------------------------------------------- forward row kernels
# MODE selects the mistake (a constexpr, so each wrong kernel is one short branch of the same code):
# 0 right, 1 variance without the mean subtracted, 2 one-pass variance E[x^2] - E[x]^2,
# 3 statistics in 16 bits (float16: the interpreter's bfloat16 arithmetic is wrong, so float16 stands in
# for the "statistics in bf16" mistake; on a GPU the bf16 version fails the same way), 4 padded lanes
# in the variance, 5 mean divided by BLOCK_SIZE, 6 rows found with n_cols instead of the stride, 7 eps
# ignored (a default of 1e-5 written in), 8 the weight loaded without a mask (lanes past n_cols read),
# 9 the sample variance (divided by n_cols - 1), 10 sqrt(var + eps) stored as rstd (not its reciprocal), 11 y stored
# with x_row_stride.


@pytest.fixture(autouse=True)
def _replayable_draws(monkeypatch):
    """These tests assert the hint each fault gets; here each check's draws come from fixed seeds, so that a
    failure replays. The checkers draw fresh inputs for a student, and name each fault on any draw: a mean's
    error is measured against its row's scale, not the mean itself (a row centred near 0 once made a float32
    mean read as a 16-bit one, and 16-bit statistics read as masked lanes), and the padded lanes' variance is
    recognised by its value, not only by elimination."""
    seeds = iter(range(20261127, 20261127 + 10**6))

    def generator(device=None):
        g = torch.Generator(device=device or cu.DEVICE)
        g.manual_seed(next(seeds))
        return g
    monkeypatch.setattr(check, "generator", generator)


@triton.jit
def _forward(y_ptr, x_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, n_cols, x_row_stride, y_row_stride, eps,
             BLOCK_SIZE: tl.constexpr, MODE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
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
    elif MODE == 9:
        var = tl.sum(xc * xc, axis=0) / (n_cols - 1)
    else:
        var = tl.sum(xc * xc, axis=0) / n_cols
    rstd = 1.0 / tl.sqrt(var.to(tl.float32) + (1e-5 if MODE == 7 else eps))
    if MODE == 8:
        w = tl.load(w_ptr + offsets).to(tl.float32)
    else:
        w = tl.load(w_ptr + offsets, mask=mask).to(tl.float32)
    b = tl.load(b_ptr + offsets, mask=mask).to(tl.float32)
    y = (x - mean).to(tl.float32) * rstd * w + b
    y_stride = x_row_stride if MODE == 11 else y_row_stride
    tl.store(y_ptr + pid * y_stride + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + pid, mean.to(tl.float32))
    if MODE == 10:
        tl.store(rstd_ptr + pid, 1.0 / rstd)
    else:
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


def test_right_forward_kernel_passes(capsys):
    checks.check_forward_kernel(_mode(0))
    assert capsys.readouterr().out.startswith("PASS LayerNorm forward")


@pytest.mark.parametrize("kernel", [L.layer_norm_fwd_kernel, TK.norm_fwd_kernel, L.rms_norm_fwd_kernel, F.layer_norm],
                         ids=lambda k: k.__name__)
def test_forward_check_refuses_the_answer_key(kernel):
    with pytest.raises(check.CheckFailure, match="answer key"):
        checks.check_forward_kernel(kernel)


def test_forward_check_refuses_a_kernel_that_calls_the_answer_key():
    @triton.jit
    def calls_ours(y_ptr, x_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, n_cols, x_row_stride, y_row_stride, eps,
                   BLOCK_SIZE: tl.constexpr):
        L.layer_norm_fwd_kernel(y_ptr, x_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, n_cols, x_row_stride,
                                y_row_stride, eps, BLOCK_SIZE)
    with pytest.raises(check.CheckFailure, match="L.layer_norm_fwd_kernel"):
        checks.check_forward_kernel(calls_ours)


@pytest.mark.parametrize("mode, words", [
    (1, "without subtracting the mean"),
    (2, "one-pass variance"),
    (3, "16 bits"),
    (4, "masked lanes"),
    (5, "BLOCK_SIZE"),
    (7, "eps"),
    pytest.param(8, "outside its inputs", marks=INTERPRETER_ONLY),
    (9, "n_cols - 1 \\(the sample variance"),
    (10, "not its reciprocal"),
    (11, "stored the rows of y 18 elements apart, the value of x_row_stride"),
])
def test_wrong_forward_kernels_fail_naming_the_fault(mode, words):
    with pytest.raises(check.CheckFailure, match=words):
        checks.check_forward_kernel(_mode(mode))


def test_wrong_row_stride_fails():
    words = "rows of x 13 elements apart, the value of y_row_stride and of n_cols"
    with pytest.raises(check.CheckFailure, match="differ" if cu.on_gpu() else words):
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
    with pytest.raises(check.CheckFailure, match="eps"):
        checks.check_layer_norm_fn(lambda x, w, b, eps: _student_layer_norm(x, w, b, 1e-5))


@pytest.mark.parametrize("fn, words", [
    (L.layer_norm_teaching, "L.layer_norm_teaching"),
    (T.layer_norm, "T.layer_norm"),
    (L.layer_norm_ref, "L.layer_norm_ref"),
    (lambda x, w, b, eps: L.layer_norm_teaching(x, w, b, eps), "L.layer_norm_teaching"),
    (lambda x, w, b, eps: T.layer_norm(x, w, b, eps), "T.layer_norm"),
    (lambda x, w, b, eps: F.layer_norm(x, x.shape[-1:], w, b, eps), "F.layer_norm"),
    (lambda x, w, b, eps: torch.layer_norm(x, x.shape[-1:], w, b, eps), "torch.layer_norm"),
], ids=["teaching", "tuned", "reference", "calls-teaching", "calls-tuned", "calls-F", "calls-torch"])
def test_launcher_check_refuses_the_answer_key(fn, words):
    with pytest.raises(check.CheckFailure, match=words):
        checks.check_layer_norm_fn(fn)


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
    with pytest.raises(NotImplementedError):
        checks.check_rms_backward_kernel(K())

# ----------------------------------------------------------------------------- dw/db reduction
# MODE: 0 right, 1 wrong axis (tl.sum over axis 1), 2 every program sums every row, 3 no column mask
# on the store, 4 x_hat without the mean subtracted, 5 a tile's rows masked with rows < n_rows instead of the
# run's end (the last tile of a run counts rows of the next run again), 6 program 0 sums every row and the
# others store 0 (the sum of the partial rows is right), 7 mean and rstd loaded without the row mask, 8 the
# accumulators in the input's dtype, 9 dy's rows found with x_row_stride, 10 x's rows found with dy_row_stride,
# 11 dw sums dy (db's sum), 12 the tile loop drops a run's last, partial tile, 13 dw and db stored swapped,
# 14 x_hat without rstd (x - mean), 15 dw sums x_hat (dy left out), 16 no loop over tiles (a run's first BLOCK_M
# rows only), 17 the partial rows stored without pid_m (every program writes row 0), 18 dy left in its dtype (each
# tile's db sum in 16 bits, added to the float32 accumulator), 19 int32 row offsets (rows * x_row_stride wraps
# past 2**31 elements).


@triton.jit
def _dw_db(dw_partial_ptr, db_partial_ptr, x_ptr, dy_ptr, mean_ptr, rstd_ptr, n_rows, n_cols, x_row_stride,
           dy_row_stride, rows_per_program, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr):
    pid_m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    first = 0 if MODE == 2 or MODE == 6 else pid_m * rows_per_program
    end = n_rows if MODE == 2 or MODE == 6 else tl.minimum(first + rows_per_program, n_rows)
    if MODE == 6:
        end = tl.where(pid_m == 0, n_rows, 0)
    start = first
    if MODE == 16:
        end = tl.minimum(end, first + BLOCK_M)
    while start < end - (BLOCK_M - 1 if MODE == 12 else 0):
        rows = start + tl.arange(0, BLOCK_M)
        row_mask = rows < (n_rows if MODE == 5 else end)
        mask = row_mask[:, None] & col_mask[None, :]
        x_stride = dy_row_stride if MODE == 10 else x_row_stride
        rows64 = rows[:, None] if MODE == 19 else rows.to(tl.int64)[:, None]   # 19: int32 row offsets
        x = tl.load(x_ptr + rows64 * x_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy_stride = x_row_stride if MODE == 9 else dy_row_stride
        dy = tl.load(dy_ptr + rows64 * dy_stride + cols[None, :], mask=mask, other=0.0)
        if MODE != 18:
            dy = dy.to(tl.float32)
        if MODE == 7:
            mean = tl.load(mean_ptr + rows)
            rstd = tl.load(rstd_ptr + rows)
        else:
            mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
            rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        if MODE == 4:
            x_hat = x * rstd[:, None]
        elif MODE == 11:
            x_hat = tl.where(mask, 1.0, 0.0)
        elif MODE == 14:
            x_hat = x - mean[:, None]
        else:
            x_hat = (x - mean[:, None]) * rstd[:, None]
        if MODE == 1:
            dw += tl.sum(dy * x_hat, axis=1)
            db += tl.sum(dy, axis=1)
        elif MODE == 8:
            dw = (dw + tl.sum(dy * x_hat, axis=0)).to(x_ptr.dtype.element_ty).to(tl.float32)
            db = (db + tl.sum(dy, axis=0)).to(x_ptr.dtype.element_ty).to(tl.float32)
        elif MODE == 15:
            dw += tl.sum(x_hat, axis=0)
            db += tl.sum(dy, axis=0)
        else:
            dw += tl.sum(dy * x_hat, axis=0)
            db += tl.sum(dy, axis=0)
        start += BLOCK_M
    store_mask = cols < BLOCK_N * tl.num_programs(1) if MODE == 3 else col_mask
    if MODE == 13:
        dw, db = db, dw
    row = 0 if MODE == 17 else pid_m
    tl.store(dw_partial_ptr + row * n_cols + cols, dw, mask=store_mask)
    tl.store(db_partial_ptr + row * n_cols + cols, db, mask=store_mask)


def _dw_mode(mode):
    class K:
        def __getitem__(self, grid):
            return lambda *a, **k: _dw_db[grid](*a, **k, MODE=mode)
    return K()


def test_right_dw_db_kernel_passes(capsys):
    checks.check_dw_db_kernel(_dw_mode(0))
    assert capsys.readouterr().out.startswith("PASS dw/db reduction")


@pytest.mark.parametrize("kernel", [L.norm_dw_db_kernel, L.column_sum_kernel, TK.norm_bwd_kernel],
                         ids=lambda k: k.__name__)
def test_dw_db_check_refuses_the_answer_key(kernel):
    with pytest.raises(check.CheckFailure, match="answer key"):
        checks.check_dw_db_kernel(kernel)


@pytest.mark.parametrize("mode, words", [
    (1, "wrong axis"),
    (2, "every partial row holds the dw sum of ALL rows"),
    (3, "outside its buffer"),
    (4, "subtracts the row's mean first"),
    (5, "rows < end"),
    (6, "partial row 0 \\(the others 0\\) holds the dw sum of ALL rows"),
    (7, "loaded them past n_rows" if cu.on_gpu() else "outside its inputs"),  # GPU: the NaN after mean reaches dw
    (8, "accumulated \\(or rounded\\) in the input's dtype"),
    (9, "dy read with x's row stride" if cu.on_gpu() else "rows of dy \\d+ elements apart, the value of x_row_stride"),
    (10, "x read with dy's row stride" if cu.on_gpu() else "rows of x \\d+ elements apart, the value of dy_row_stride"),
    (11, "partial dw rows hold db's sums"),
    (12, "misses the rows of its run's last, partial tile"),
    (13, "the two stores are swapped"),
    (14, "times the row's rstd too"),
    (15, "dw matches sum\\(x_hat\\)"),
    (16, "the first BLOCK_M rows of its run only"),
    (17, "never written"),
    (18, "right to float16's precision only(.|\n)*tl.sum of a float16 tile returns float16"),
])
def test_wrong_dw_db_kernels_fail_naming_the_fault(mode, words):
    with pytest.raises(check.CheckFailure, match=words):
        checks.check_dw_db_kernel(_dw_mode(mode))


@pytest.mark.parametrize("mode, words", [(9, "dy read with x's row stride"), (10, "x read with dy's row stride"),
                                         (4, "subtracts the row's mean first"), (7, "loaded them past n_rows")])
def test_dw_db_faults_are_named_from_the_output_alone(mode, words, monkeypatch):
    """With the load records switched off (as on a GPU), the partial rows themselves name the fault."""
    import contextlib

    from course_utils.checkers import loads
    monkeypatch.setattr(check, "track_loads", lambda: contextlib.nullcontext(loads.Loads()))
    with pytest.raises(check.CheckFailure, match=words):
        checks.check_dw_db_kernel(_dw_mode(mode))


@triton.jit
def _dw_db_row_loop(dw_partial_ptr, db_partial_ptr, x_ptr, dy_ptr, mean_ptr, rstd_ptr, n_rows, n_cols, x_row_stride,
                    dy_row_stride, rows_per_program, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Valid compiled Triton, row by row: r.to(tl.int64) on the loop variable, which the interpreter refuses."""
    pid_m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    first = pid_m * rows_per_program
    for r in tl.range(first, tl.minimum(first + rows_per_program, n_rows)):
        r64 = r.to(tl.int64)
        x = tl.load(x_ptr + r64 * x_row_stride + cols, mask=col_mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + r64 * dy_row_stride + cols, mask=col_mask, other=0.0).to(tl.float32)
        x_hat = (x - tl.load(mean_ptr + r64)) * tl.load(rstd_ptr + r64)
        dw += dy * x_hat
        db += dy
    tl.store(dw_partial_ptr + pid_m * n_cols + cols, dw, mask=col_mask)
    tl.store(db_partial_ptr + pid_m * n_cols + cols, db, mask=col_mask)


@pytest.mark.skipif(cu.on_gpu(), reason="an interpreter limit: compiled, the kernel runs")
def test_an_interpreter_limit_is_not_reported_as_the_students_error():
    with pytest.raises(check.CheckFailure, match="a limit of the interpreter, not a fault of your kernel.*tl.cast"):
        checks.check_dw_db_kernel(_dw_db_row_loop)


def test_fresh_inputs_every_call():
    a = checks._inputs(3, 10, torch.float32)[1].clone()
    b = checks._inputs(3, 10, torch.float32)[1].clone()
    assert not torch.equal(a, b)
    assert float(a[0].mean()) > 900 and abs(float(a[1].mean())) < 100  # even rows sit on the offset


# ----------------------------------------------------------------------------- RMSNorm dx, rstd recomputed
# MODE: 0 right, 1 eps ignored (1e-6 written in), 2 LayerNorm's formula (mean subtracted, mean(g) term),
# 3 dx = g * rstd (the x_hat * mean(g * x_hat) term forgotten), 4 means divided by BLOCK_SIZE, 5 the weight
# loaded without a mask, 6 dy's rows found with x_row_stride, 7 the weight left out (g = dy), 8 the weight
# multiplied in at the end, 9 x_hat * sum(g * x_hat) not divided by n_cols, 10 the last factor rstd left out,
# 11 the sum taken over dy * x_hat (the weight left out of it alone), 12 dx stored with x_row_stride, 13 dy and w
# left in their dtype (g = dy * w in 16 bits), 14 int32 row offsets (pid * x_row_stride wraps past 2**31 elements).


@triton.jit
def _rms_dx(dx_ptr, dy_ptr, x_ptr, w_ptr, n_cols, x_row_stride, dy_row_stride, dx_row_stride, eps,
            BLOCK_SIZE: tl.constexpr, MODE: tl.constexpr):
    pid = tl.program_id(0) if MODE == 14 else tl.program_id(0).to(tl.int64)   # 14: int32 row offsets
    offsets = tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_cols
    n = BLOCK_SIZE if MODE == 4 else n_cols
    x = tl.load(x_ptr + pid * x_row_stride + offsets, mask=mask, other=0.0).to(tl.float32)
    dy_stride = x_row_stride if MODE == 6 else dy_row_stride
    dy = tl.load(dy_ptr + pid * dy_stride + offsets, mask=mask, other=0.0)
    if MODE == 5:
        w = tl.load(w_ptr + offsets)
    else:
        w = tl.load(w_ptr + offsets, mask=mask, other=0.0)
    if MODE != 13:
        dy, w = dy.to(tl.float32), w.to(tl.float32)
    if MODE == 2:
        x = tl.where(mask, x - tl.sum(x, axis=0) / n, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + (1e-6 if MODE == 1 else eps))
    x_hat = x * rstd
    g = tl.where(mask, dy if MODE == 7 or MODE == 8 else dy * w, 0.0)
    if MODE == 3:
        dx = g * rstd
    elif MODE == 2:
        dx = (g - x_hat * tl.sum(g * x_hat, axis=0) / n - tl.sum(g, axis=0) / n) * rstd
    elif MODE == 8:
        dx = (g - x_hat * tl.sum(g * x_hat, axis=0) / n) * rstd * w
    elif MODE == 9:
        dx = (g - x_hat * tl.sum(g * x_hat, axis=0)) * rstd
    elif MODE == 10:
        dx = g - x_hat * tl.sum(g * x_hat, axis=0) / n
    elif MODE == 11:
        dx = (g - x_hat * tl.sum(tl.where(mask, dy, 0.0) * x_hat, axis=0) / n) * rstd
    else:
        dx = (g - x_hat * tl.sum(g * x_hat, axis=0) / n) * rstd
    dx_stride = x_row_stride if MODE == 12 else dx_row_stride
    tl.store(dx_ptr + pid * dx_stride + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def _rms_mode(mode):
    class K:
        def __getitem__(self, grid):
            return lambda *a, **k: _rms_dx[grid](*a, **k, MODE=mode)
    return K()


def test_right_rms_backward_kernel_passes(capsys):
    checks.check_rms_backward_kernel(_rms_mode(0))
    assert capsys.readouterr().out.startswith("PASS RMSNorm backward dx")


@pytest.mark.parametrize("kernel", [L.norm_bwd_dx_kernel, TK.norm_bwd_kernel, TK.norm_bwd_chunked_kernel, F.rms_norm,
                                    T.rms_norm_backward], ids=lambda k: k.__name__)
def test_rms_backward_check_refuses_the_answer_key(kernel):
    with pytest.raises(check.CheckFailure, match="answer key"):
        checks.check_rms_backward_kernel(kernel)


@pytest.mark.parametrize("mode, words", [
    (1, "eps"),
    (2, "LayerNorm's dx"),
    (3, "x_hat \\* mean\\(g \\* x_hat\\)"),
    (4, "BLOCK_SIZE"),
    pytest.param(5, "outside its inputs", marks=INTERPRETER_ONLY),
    (6, "dy read with x.s row stride" if cu.on_gpu() else "rows of dy \\d+ elements apart, the value of x_row_stride"),
    (7, "dx leaves out the weight"),
    (8, "w multiplies dx at the end"),
    (9, "not divided by n_cols"),
    (10, "misses its last factor rstd"),
    (11, "is over dy \\* x_hat"),
    (12, "stored the rows of dx 18 elements apart, the value of x_row_stride"),
    (13, "further from the float64 answer than float32 math rounded once to float16"),
])
def test_wrong_rms_backward_kernels_fail_naming_the_fault(mode, words):
    with pytest.raises(check.CheckFailure, match=words):
        checks.check_rms_backward_kernel(_rms_mode(mode))


def test_a_stride_mixup_is_named_from_the_output_alone():
    """What a GPU check sees (no loads recorded): dx computed with dy's rows read at x's row stride is named."""
    x = checks._inputs(37, 300, torch.float32)[1]
    dy = check.randn((40, 303))[:37, :300]   # rows past the view: a read at x's larger stride stays in memory
    w = check.randn((300,), scale=0.5, offset=1.0)
    dx = torch.empty((37, 300), device=x.device)
    _rms_dx[(37,)](dx, dy, x, w, 300, x.stride(0), dy.stride(0), dx.stride(0), checks.EPS, BLOCK_SIZE=512, MODE=6)
    x64, dy64, w64 = (t.to("cpu", torch.float64) for t in (x, dy, w))
    hint = checks._rms_diagnose(dx.to("cpu", torch.float64), x64, dy64, w64, x, dy)
    assert "dy read with x's row stride" in hint, hint


# ----------------------------------------------------------------------------- forward in chunks (Welford)
# MODE: 0 right (Welford's statistics per chunk, merged with Chan's formula; a second loop writes y),
# 1 one-pass sums of x and x^2 over the chunks (E[x^2] - E[x]^2), 2 the last, partial chunk counted as
# BLOCK_SIZE lanes, 3 its padded lanes in the chunk's M2, 4 Chan's merge without the delta^2 term, 5 three passes
# (the mean, then the centered squares, then y: right numbers, not Welford), 6 delta^2 taken from the mean after
# its update, 7 eps outside the square root, 8 eps added after it, 9 w and b loaded at the first chunk's columns
# in every chunk of the y pass, 10 the statistics of the row's first chunk alone (no loop for them), 11 int32 row
# offsets (pid * x_row_stride wraps past 2**31 elements), 12 the count updated before M2's delta^2 term.


@triton.jit
def _chunked(y_ptr, x_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, n_cols, x_row_stride, y_row_stride, eps,
             BLOCK_SIZE: tl.constexpr, MODE: tl.constexpr):
    pid = tl.program_id(0) if MODE == 11 else tl.program_id(0).to(tl.int64)   # 11: int32 row offsets
    offsets = tl.arange(0, BLOCK_SIZE)
    count = 0.0
    mean = 0.0
    m2 = 0.0
    for start in tl.range(0, BLOCK_SIZE if MODE == 10 else n_cols, BLOCK_SIZE):
        mask = start + offsets < n_cols
        x = tl.load(x_ptr + pid * x_row_stride + start + offsets, mask=mask, other=0.0).to(tl.float32)
        if MODE == 1 or MODE == 5:
            mean += tl.sum(x, axis=0)
            m2 += tl.sum(x * x, axis=0)
        else:
            if MODE == 2:
                n_b = BLOCK_SIZE * 1.0
            else:
                n_b = tl.sum(mask.to(tl.float32), axis=0)
            mean_b = tl.sum(x, axis=0) / n_b
            if MODE == 3:
                xc = x - mean_b
            else:
                xc = tl.where(mask, x - mean_b, 0.0)
            delta = mean_b - mean
            total = count + n_b
            mean += delta * n_b / total
            if MODE == 6:
                delta = mean_b - mean
            if MODE == 4:
                m2 += tl.sum(xc * xc, axis=0)
            elif MODE == 12:   # the count moved before M2's delta^2 term: n_a = n there
                count = total
                m2 += tl.sum(xc * xc, axis=0) + delta * delta * count * n_b / total
            else:
                m2 += tl.sum(xc * xc, axis=0) + delta * delta * count * n_b / total
            count = total
    if MODE == 1:
        mean = mean / n_cols
        m2 = m2 - mean * mean * n_cols
    if MODE == 5:   # the two-pass variance: a second read of the row for the centered squares
        mean = mean / n_cols
        m2 = 0.0
        for start in tl.range(0, n_cols, BLOCK_SIZE):
            mask = start + offsets < n_cols
            x = tl.load(x_ptr + pid * x_row_stride + start + offsets, mask=mask, other=0.0).to(tl.float32)
            xc = tl.where(mask, x - mean, 0.0)
            m2 += tl.sum(xc * xc, axis=0)
    if MODE == 10:
        m2 = m2 * n_cols / count   # the first chunk's variance, as if it were the row's
    if MODE == 7:
        rstd = 1.0 / (tl.sqrt(m2 / n_cols) + eps)
    elif MODE == 8:
        rstd = 1.0 / tl.sqrt(m2 / n_cols) + eps
    else:
        rstd = 1.0 / tl.sqrt(m2 / n_cols + eps)
    for start in tl.range(0, n_cols, BLOCK_SIZE):
        mask = start + offsets < n_cols
        x = tl.load(x_ptr + pid * x_row_stride + start + offsets, mask=mask, other=0.0).to(tl.float32)
        wb = offsets if MODE == 9 else start + offsets
        w = tl.load(w_ptr + wb, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + wb, mask=mask, other=0.0).to(tl.float32)
        y = (x - mean) * rstd * w + b
        tl.store(y_ptr + pid * y_row_stride + start + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + pid, mean)
    tl.store(rstd_ptr + pid, rstd)


def _chunked_mode(mode):
    class K:
        def __getitem__(self, grid):
            return lambda *a, **k: _chunked[grid](*a, **k, MODE=mode)
    return K()


def test_chunked_welford_kernel_passes_the_chunked_check(capsys):
    checks.check_forward_kernel(_chunked_mode(0), "chunked", chunk=64)
    assert capsys.readouterr().out.startswith("PASS chunked")


@pytest.mark.parametrize("mode, words", [(2, "partial last chunk as full"), (3, "masked lanes add to the variance"),
                                         (4, "Chan's merge lost its delta"),
                                         (6, "delta from the mean after its update"),
                                         (7, "eps is outside the square root"), (8, "eps is outside the square root"),
                                         (9, "w and b read at the first chunk's columns"),
                                         (10, "first chunk alone"),
                                         (12, "takes n_a after the count moved"),
                                         pytest.param(5, "reads each element of x 3.00 times", marks=INTERPRETER_ONLY)])
def test_wrong_chunked_kernels_fail_naming_the_fault(mode, words):
    with pytest.raises(check.CheckFailure, match=words):
        checks.check_forward_kernel(_chunked_mode(mode), chunk=64)


def test_chunked_check_fails_one_pass_sums_and_a_whole_row_kernel():
    with pytest.raises(check.CheckFailure, match="one-pass variance"):
        checks.check_forward_kernel(_chunked_mode(1), chunk=64)
    with pytest.raises(check.CheckFailure, match="first chunk alone"):
        checks.check_forward_kernel(_mode(0), chunk=64)  # the whole row in one block: only its first chunk


@pytest.mark.parametrize("exercise", ["10.1", "10.2", "10.3"])
def test_int32_row_offsets_fail_past_2_31_elements(exercise):
    """The case each chapter 10 kernel check ends with, on its own (the right kernels pass it in the checks above):
    float16 rows whose last starts past 2**31 elements, where pid * x_row_stride in int32 wraps."""
    from course_utils.checkers import layernorm_backward as LB
    from course_utils.checkers import rms_backward as RB
    if exercise == "10.1":
        run = lambda: checks._check_forward_past_2_31(_chunked_mode(11), "chunked", 64, "")  # noqa: E731
        words = "past 2\\*\\*31(.|\n)*never wrote the last row of y(.|\n)*pid.to\\(tl.int64\\) \\* x_row_stride"
    elif exercise == "10.2":
        run = lambda: RB._rms_past_2_31(_rms_mode(14), "rms", "")  # noqa: E731
        words = "past 2\\*\\*31(.|\n)*never wrote the last row of dx(.|\n)*pid.to\\(tl.int64\\) \\* x_row_stride"
    else:
        run = lambda: LB._dw_past_2_31(_dw_mode(19), "dw/db")  # noqa: E731
        words = "past 2\\*\\*31(.|\n)*rows.to\\(tl.int64\\) \\* x_row_stride"
    with pytest.raises(check.CheckFailure, match=words):
        run()
