"""The chapter 5-6 checkers pass the right answers and fail the usual wrong ones."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import course_utils as cu
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


@triton.jit
def _y_stride_ignored(y_ptr, x_ptr, n_cols, x_row_stride, y_row_stride, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(0)
    offsets = tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_cols
    x = tl.load(x_ptr + pid * x_row_stride + offsets, mask=mask, other=-float("inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(y_ptr + pid * n_cols + offsets, (e / tl.sum(e, axis=0)).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _input_dtype_math(y_ptr, x_ptr, n_cols, x_row_stride, y_row_stride, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(0)
    offsets = tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_cols
    x = tl.load(x_ptr + pid * x_row_stride + offsets, mask=mask, other=-float("inf"))  # fp16 stays fp16
    e = tl.exp(x - tl.max(x, axis=0)).to(x.dtype)
    y = e / tl.sum(e, axis=0).to(x.dtype)
    tl.store(y_ptr + pid * y_row_stride + offsets, y.to(x.dtype).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _two_pass(y_ptr, x_ptr, n_cols, x_row_stride, y_row_stride, BLOCK_SIZE: tl.constexpr):
    """The online softmax as exercise 6.2 teaches it: for ... in tl.range, two passes over the row."""
    pid = tl.program_id(0)
    offsets = tl.arange(0, BLOCK_SIZE)
    m = -float("inf")
    s = 0.0
    for start in tl.range(0, n_cols, BLOCK_SIZE):
        cols = start + offsets
        x = tl.load(x_ptr + pid * x_row_stride + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        s = s * tl.exp(m - safe) + tl.sum(tl.exp(x - safe), axis=0)
        m = m_new
    for start in tl.range(0, n_cols, BLOCK_SIZE):
        cols = start + offsets
        mask = cols < n_cols
        x = tl.load(x_ptr + pid * x_row_stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
        tl.store(y_ptr + pid * y_row_stride + cols, (tl.exp(x - m) / s).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _three_pass(y_ptr, x_ptr, n_cols, x_row_stride, y_row_stride, BLOCK_SIZE: tl.constexpr):
    """Right numbers, but max, sum and write each read the row: not the online lesson."""
    pid = tl.program_id(0)
    offsets = tl.arange(0, BLOCK_SIZE)
    m = -float("inf")
    for start in tl.range(0, n_cols, BLOCK_SIZE):
        cols = start + offsets
        x = tl.load(x_ptr + pid * x_row_stride + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
        m = tl.maximum(m, tl.max(x, axis=0))
    safe = tl.where(m == -float("inf"), 0.0, m)
    s = 0.0
    for start in tl.range(0, n_cols, BLOCK_SIZE):
        cols = start + offsets
        x = tl.load(x_ptr + pid * x_row_stride + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
        s += tl.sum(tl.exp(x - safe), axis=0)
    for start in tl.range(0, n_cols, BLOCK_SIZE):
        cols = start + offsets
        mask = cols < n_cols
        x = tl.load(x_ptr + pid * x_row_stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
        tl.store(y_ptr + pid * y_row_stride + cols, (tl.exp(x - m) / s).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _one_wide_tile(y_ptr, x_ptr, n_cols, x_row_stride, y_row_stride, BLOCK_SIZE: tl.constexpr):
    """Ignores BLOCK_SIZE and loads the row as one 4096-wide tile: wrong past 4096 columns."""
    pid = tl.program_id(0)
    offsets = tl.arange(0, 4096)
    mask = offsets < n_cols
    x = tl.load(x_ptr + pid * x_row_stride + offsets, mask=mask, other=-float("inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(y_ptr + pid * y_row_stride + offsets, (e / tl.sum(e, axis=0)).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _masked_after_the_load(y_ptr, x_ptr, n_cols, x_row_stride, y_row_stride, BLOCK_SIZE: tl.constexpr):
    """Right numbers, but the lanes past the row load before tl.where drops them: a read out of bounds."""
    pid = tl.program_id(0)
    offsets = tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_cols
    x = tl.where(mask, tl.load(x_ptr + pid * x_row_stride + offsets).to(tl.float32), -float("inf"))
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(y_ptr + pid * y_row_stride + offsets, (e / tl.sum(e, axis=0)).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _writing_loop_unmasked_load(y_ptr, x_ptr, n_cols, x_row_stride, y_row_stride, BLOCK_SIZE: tl.constexpr):
    """The online loops with no mask on the writing loop's load (its store is masked): a read out of bounds."""
    pid = tl.program_id(0)
    offsets = tl.arange(0, BLOCK_SIZE)
    m = -float("inf")
    s = 0.0
    for start in tl.range(0, n_cols, BLOCK_SIZE):
        cols = start + offsets
        x = tl.load(x_ptr + pid * x_row_stride + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        s = s * tl.exp(m - safe) + tl.sum(tl.exp(x - safe), axis=0)
        m = m_new
    for start in tl.range(0, n_cols, BLOCK_SIZE):
        cols = start + offsets
        x = tl.load(x_ptr + pid * x_row_stride + cols).to(tl.float32)
        tl.store(y_ptr + pid * y_row_stride + cols, (tl.exp(x - m) / s).to(y_ptr.dtype.element_ty), mask=cols < n_cols)


@triton.jit
def _zero_padding_masked_sum(y_ptr, x_ptr, n_cols, x_row_stride, y_row_stride, BLOCK_SIZE: tl.constexpr):
    """Pads with 0 but leaves the padding out of the sum: right unless the whole row is far below 0."""
    pid = tl.program_id(0)
    offsets = tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_cols
    x = tl.load(x_ptr + pid * x_row_stride + offsets, mask=mask, other=0.0).to(tl.float32)
    e = tl.where(mask, tl.exp(x - tl.max(x, axis=0)), 0.0)
    tl.store(y_ptr + pid * y_row_stride + offsets, (e / tl.sum(e, axis=0)).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _max_from_zero(y_ptr, x_ptr, n_cols, x_row_stride, y_row_stride, BLOCK_SIZE: tl.constexpr):
    """The online loops with the running max started at 0, not -inf: exp(x - 0) underflows on a row far below 0."""
    pid = tl.program_id(0)
    offsets = tl.arange(0, BLOCK_SIZE)
    m = 0.0
    s = 0.0
    for start in tl.range(0, n_cols, BLOCK_SIZE):
        cols = start + offsets
        x = tl.load(x_ptr + pid * x_row_stride + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    for start in tl.range(0, n_cols, BLOCK_SIZE):
        cols = start + offsets
        mask = cols < n_cols
        x = tl.load(x_ptr + pid * x_row_stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
        tl.store(y_ptr + pid * y_row_stride + cols, (tl.exp(x - m) / s).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _y_read_back(y_ptr, x_ptr, n_cols, x_row_stride, y_row_stride, BLOCK_SIZE: tl.constexpr):
    """Reads x twice, but writes exp(x - m) into y and divides it in a third loop over y: no online rescale."""
    pid = tl.program_id(0)
    offsets = tl.arange(0, BLOCK_SIZE)
    m = -float("inf")
    for start in tl.range(0, n_cols, BLOCK_SIZE):
        cols = start + offsets
        x = tl.load(x_ptr + pid * x_row_stride + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
        m = tl.maximum(m, tl.max(x, axis=0))
    s = 0.0
    for start in tl.range(0, n_cols, BLOCK_SIZE):
        cols = start + offsets
        mask = cols < n_cols
        x = tl.load(x_ptr + pid * x_row_stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
        e = tl.exp(x - m)
        s += tl.sum(e, axis=0)
        tl.store(y_ptr + pid * y_row_stride + cols, e.to(y_ptr.dtype.element_ty), mask=mask)
    for start in tl.range(0, n_cols, BLOCK_SIZE):
        cols = start + offsets
        mask = cols < n_cols
        e = tl.load(y_ptr + pid * y_row_stride + cols, mask=mask).to(tl.float32)
        tl.store(y_ptr + pid * y_row_stride + cols, (e / s).to(y_ptr.dtype.element_ty), mask=mask)


def test_row_checker_passes_a_right_kernel(capsys):
    checks.check_row_kernel(_two_pass)  # a right kernel of the tests' own (one tile: the loop runs once)
    assert capsys.readouterr().out.startswith("PASS fused softmax")


@pytest.mark.parametrize("kernel, words", [
    (_no_load_mask, "outside the rows of x" if not cu.on_gpu() else "differ"),
    (_masked_after_the_load, "outside the rows of x" if not cu.on_gpu() else None),
    (_zero_padding, "masked lanes are loaded as 0 \\(other=0.0\\)"),
    (_unstable_exp, "got nan(.|\n)*the row's max is not subtracted"),
    (_wrong_stride, "outside the rows of x" if not cu.on_gpu() else "differ"),
    (_no_store_mask, "outside"),
    (_y_stride_ignored, "y_row_stride"),            # issue 17: ignoring y_row_stride
    (_input_dtype_math, "half a unit|differ"),      # issue 17: computing in the input dtype
    (_zero_padding_masked_sum, "values around -300"),
])
def test_row_checker_fails_wrong_kernels(kernel, words):
    if words is None:
        pytest.skip("loads are inspected under the interpreter only")
    with pytest.raises(check.CheckFailure, match=words):
        checks.check_row_kernel(kernel)


def test_row_checker_reports_a_crash():
    @triton.jit
    def _crash(y_ptr, x_ptr, n_cols, x_row_stride, y_row_stride, BLOCK_SIZE: tl.constexpr):
        raise NotImplementedError("Exercise 5.1")

    with pytest.raises((check.CheckFailure, NotImplementedError)):
        checks.check_row_kernel(_crash)


def test_long_row_checker_passes_the_course_kernel(capsys):
    checks.check_long_row_kernel(_two_pass)
    assert "PASS online softmax, long rows" in capsys.readouterr().out


@pytest.mark.parametrize("kernel, words", [
    (_first_tile_only, ""), (_no_correction, "not rescaled when the max grows(.|\n)*rescale s by exp"),
    (_nan_on_minus_inf, ""),
    (_y_stride_ignored, "y_row_stride"),
    (_one_wide_tile, "lanes at once" if not cu.on_gpu() else "differ|NaN"),   # issue 17: a 4096-wide tile
    (_three_pass, "3 times" if not cu.on_gpu() else None),                     # issue 18 item 15
    (_max_from_zero, "values around -300"),
    (_y_read_back, "of y, its output" if not cu.on_gpu() else None),
    (_writing_loop_unmasked_load, "outside the rows of x" if not cu.on_gpu() else None),
])
def test_long_row_checker_fails_wrong_kernels(kernel, words):
    if words is None:
        pytest.skip("loads and passes over the row are counted under the interpreter only")
    with pytest.raises(check.CheckFailure, match=words):
        checks.check_long_row_kernel(kernel)


def _launcher(kernel):
    def fused_softmax(x):
        y = torch.empty_like(x)
        kernel[(x.shape[0],)](y, x, x.shape[1], x.stride(0), y.stride(0), BLOCK_SIZE=triton.next_power_of_2(x.shape[1]))
        return y
    return fused_softmax


def test_launcher_checker(capsys):
    checks.check_launcher(_launcher(_two_pass))
    assert capsys.readouterr().out == "PASS fused_softmax: matches torch.softmax in one kernel launch\n"
    with pytest.raises(check.CheckFailure, match="ran in torch"):      # issue 17: torch.softmax in 5.1
        checks.check_launcher(lambda x: torch.softmax(x, -1))
    with pytest.raises(check.CheckFailure, match="the course's"):
        checks.check_launcher(sm.softmax_teaching)


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


# ------------------------------------------------------------------ the answer-key rule

@pytest.mark.parametrize("checker,answer", [
    (checks.check_row_kernel, sm.softmax_row_kernel),
    (checks.check_long_row_kernel, sm.softmax_online_kernel),
    (checks.check_launcher, sm.softmax_teaching),
    (checks.check_launcher, sm.softmax_ref),
], ids=["row kernel", "online kernel", "launcher", "reference"])
def test_the_course_answer_is_refused(checker, answer):
    with pytest.raises(check.CheckFailure, match="course"):
        checker(answer)


def test_the_long_row_answer_of_the_ptx_facts_is_refused():
    from course_utils import ptx_facts
    with pytest.raises(check.CheckFailure, match="long_row_forms_kernel"):
        checks.check_long_row_kernel(ptx_facts.long_row_forms_kernel)
    from course_utils.tuned import softmax as tuned_softmax
    with pytest.raises(check.CheckFailure, match="tuned.softmax.softmax"):
        checks.check_launcher(lambda x: tuned_softmax.softmax(x))


# ------------------------------------------------------------------ more usual mistakes, each named

@triton.jit
def _long_more(y_ptr, x_ptr, n_cols, x_row_stride, y_row_stride, BLOCK_SIZE: tl.constexpr, MODE: tl.constexpr):
    x_row = x_ptr + tl.program_id(0) * x_row_stride
    y_row = y_ptr + tl.program_id(0) * y_row_stride
    if MODE == 1:    # right: a finite start far below any value instead of -inf
        m = tl.full([BLOCK_SIZE], -1e30, tl.float32)
    else:
        m = tl.full([BLOCK_SIZE], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_SIZE], tl.float32)
    n_tiles = n_cols // BLOCK_SIZE if MODE == 2 else tl.cdiv(n_cols, BLOCK_SIZE)   # 2: the partial tile dropped
    for t in range(0, n_tiles):
        cols = t * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        x = tl.load(x_row + cols, mask=cols < n_cols, other=0.0 if MODE == 5 else float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        if MODE == 4:    # rescaled by exp(m_new - m): inverted
            s = s * tl.exp(safe - tl.where(m == float("-inf"), 0.0, m)) + tl.exp(x - safe)
        else:
            s = s * tl.exp(m - safe) + tl.exp(x - safe)
        m = m_new
    m_row = tl.max(m, 0)
    s_row = tl.sum(s * tl.exp(m - m_row), 0)
    for t in range(0, tl.cdiv(n_cols, BLOCK_SIZE)):
        cols = t * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        x = tl.load(x_row + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        y = tl.exp(x - m_row) if MODE == 3 else tl.exp(x - m_row) / s_row     # 3: no division by the sum
        tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=cols < n_cols)


class _LongMore:
    """``kernel[grid](...)`` of _long_more with one MODE, as the checker launches a student's kernel."""

    def __init__(self, mode):
        self.mode = mode

    def __getitem__(self, grid):
        return lambda *args, **kw: _long_more[grid](*args, MODE=self.mode, **kw)


def test_long_row_checker_passes_a_finite_start_below_every_value(capsys):
    checks.check_long_row_kernel(_LongMore(1))
    assert "PASS online softmax, long rows" in capsys.readouterr().out


@pytest.mark.parametrize("mode, words", [(2, "got nan"), (3, "without dividing it by the row's sum"),
                                         (4, "rescaled by exp\\(m_new - m\\), the inverse"),
                                         (5, "masked lanes are loaded as 0 \\(other=0.0\\)")])
def test_long_row_checker_fails_more_wrong_kernels(mode, words):
    with pytest.raises(check.CheckFailure, match=words):
        checks.check_long_row_kernel(_LongMore(mode))


def _update_with(m_of, s_scale, tile_m):
    def update(m, s, tile):
        m_new = m_of(m, tile)
        safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
        old = torch.where(m == float("-inf"), torch.zeros_like(m), m)
        rescale = torch.nan_to_num(torch.exp(s_scale(m, safe)), nan=0.0, posinf=0.0)
        return m_new, s * rescale + torch.exp(tile - (old if tile_m == "old" else safe)[:, None]).sum(-1)
    return update


def _max(m, tile):
    return torch.maximum(m, tile.amax(-1))


@pytest.mark.parametrize("update, words", [
    (_update_with(lambda m, t: t.amax(-1), lambda m, new: m - new, "new"), "running max m"),   # the tile's max only
    (_update_with(_max, lambda m, new: new - m, "new"), "running sum s"),                     # rescaled the wrong way
    (_update_with(_max, lambda m, new: m - new, "old"), "running sum s"),                     # tile shifted by old m
    (lambda m, s, t: _good_update(m, s, t)[::-1], "running max m"),                           # (s, m) returned
    (lambda m, s, t: _good_update(m.float(), s.float(), t.float()), "float32's precision"),   # m and s in float32
])
def test_update_checker_names_more_wrong_rules(update, words):
    with pytest.raises(check.CheckFailure, match=words):
        checks.check_online_update(update)


def _update_slip(slip):
    def update(m, s, t):
        m_new = torch.maximum(m, t.amax(-1))
        safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
        old = torch.where(m == float("-inf"), torch.zeros_like(m), m)
        if slip == "no rescale":
            return m_new, s + torch.exp(t - safe[:, None]).sum(-1)
        if slip == "inverted":
            return m_new, s * torch.exp(safe - old) + torch.exp(t - safe[:, None]).sum(-1)
        if slip == "no max":
            return m_new, s + torch.exp(t).sum(-1)
        own = torch.where(t.amax(-1) == float("-inf"), torch.zeros_like(m), t.amax(-1))   # the tile's own max
        return m_new, s * torch.exp(m - safe) + torch.exp(t - own[:, None]).sum(-1)
    return update


@pytest.mark.parametrize("slip, words", [
    ("no rescale", "Likely cause: the running sum is not rescaled when the max grows"),
    ("inverted", "Likely cause: the running sum is rescaled by exp\\(m_new - m\\), the inverse"),
    ("no max", "Likely cause: the row's max is not subtracted: exp\\(tile - m_new\\)"),
    ("own max", "Likely cause: the tile's terms are shifted by the tile's own max"),
])
def test_update_checker_names_each_slip(slip, words):
    with pytest.raises(check.CheckFailure, match=words):
        checks.check_online_update(_update_slip(slip))


def test_rows_read_n_cols_apart_are_named_from_the_output_alone(monkeypatch):
    """On a GPU no load is recorded: the row-stride slip is named from what the kernel wrote."""
    import contextlib

    from course_utils.checkers import loads
    monkeypatch.setattr(check, "track_loads", lambda: contextlib.nullcontext(loads.Loads()))
    with pytest.raises(check.CheckFailure, match="row pid is read at x_ptr \\+ pid \\* n_cols"):
        checks.check_row_kernel(_wrong_stride)


def test_an_unstable_exp_is_named_on_the_first_case_whatever_the_draw(monkeypatch):
    """Each even row holds a value >= OFFSET: drawn all below 88.7, where exp overflows float32, a 1x1 case
    passed the unstable kernel (about 1 run in 200) and a later case named the deep row's fault instead."""
    randn = checks.check.randn

    def low_draw(shape, dtype=torch.float32, **kw):
        if kw.get("offset") == checks.OFFSET:
            kw.update(offset=80.0, scale=1.0, outliers=0.0)
        return randn(shape, dtype, **kw)
    monkeypatch.setattr(checks.check, "randn", low_draw)
    with pytest.raises(check.CheckFailure, match=r"\(float32, 1 rows x 1 cols\).*got nan"):
        checks.check_row_kernel(_unstable_exp)


# ------------------------------------------------------------------ rows a whole number of tiles long

@triton.jit
def _full_tiles_then_tail(y_ptr, x_ptr, n_cols, x_row_stride, y_row_stride, BLOCK_SIZE: tl.constexpr,
                          SHORT_STATS: tl.constexpr, SHORT_WRITE: tl.constexpr):
    """Exercise 6.2 with unmasked full tiles and a masked tail; SHORT_*: that loop's bound is start < n_cols -
    BLOCK_SIZE (one tile short when n_cols is a multiple of BLOCK_SIZE, right on every other length)."""
    pid = tl.program_id(0)
    x_row = x_ptr + pid.to(tl.int64) * x_row_stride
    y_row = y_ptr + pid.to(tl.int64) * y_row_stride
    offsets = tl.arange(0, BLOCK_SIZE)
    full = n_cols // BLOCK_SIZE * BLOCK_SIZE
    m = -float("inf")
    s = 0.0
    for start in range(0, n_cols - BLOCK_SIZE if SHORT_STATS else full, BLOCK_SIZE):
        x = tl.load(x_row + start + offsets).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        s = s * tl.exp(m - safe) + tl.sum(tl.exp(x - safe), axis=0)
        m = m_new
    cols = full + offsets
    x = tl.load(x_row + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
    m_new = tl.maximum(m, tl.max(x, axis=0))
    safe = tl.where(m_new == -float("inf"), 0.0, m_new)
    s = s * tl.exp(m - safe) + tl.sum(tl.exp(x - safe), axis=0)
    m = m_new
    for start in range(0, n_cols - BLOCK_SIZE if SHORT_WRITE else full, BLOCK_SIZE):
        x = tl.load(x_row + start + offsets).to(tl.float32)
        tl.store(y_row + start + offsets, (tl.exp(x - m) / s).to(y_ptr.dtype.element_ty))
    x = tl.load(x_row + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
    tl.store(y_row + cols, (tl.exp(x - m) / s).to(y_ptr.dtype.element_ty), mask=cols < n_cols)


class _FullTiles:
    def __init__(self, short_stats, short_write):
        self.kw = {"SHORT_STATS": short_stats, "SHORT_WRITE": short_write}

    def __getitem__(self, grid):
        return lambda *args, **kw: _full_tiles_then_tail[grid](*args, **self.kw, **kw)


# the checker's one row length that is a whole number of its 128-wide tiles: 64 tiles on a GPU, 4 under the interpreter
_TILES = 64 if cu.on_gpu() else 4
_WHOLE = rf"(?s)x {_TILES * 128} cols\)"


@pytest.mark.parametrize("short_stats, short_write, words", [
    (True, False, _WHOLE + r".*last tile of the row is left out of the running max and sum when n_cols is a "
                  rf"multiple of BLOCK_SIZE \({_TILES * 128} = {_TILES} x 128"),
    (False, True, _WHOLE + r".*last tile of the row is never written when n_cols is a multiple of BLOCK_SIZE"),
    (True, True, _WHOLE + r".*never written when n_cols is a multiple.*running max and sum stops one tile early too"),
], ids=["max and sum", "write", "both"])
def test_long_row_checker_names_a_full_tile_loop_one_tile_short(short_stats, short_write, words):
    """Passed before: no row length tried was a multiple of BLOCK_SIZE, where such a loop misses the last tile."""
    with pytest.raises(check.CheckFailure, match=words):
        checks.check_long_row_kernel(_FullTiles(short_stats, short_write))
