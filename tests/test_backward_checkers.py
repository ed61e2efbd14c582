"""Chapter 11's checkers pass a right kernel and fail each usual wrong one with a message naming the fault."""

import pytest
import triton
import triton.language as tl

from course_utils import check
from course_utils.checkers import backward as checks
from course_utils.kernels.gelu_backward import gelu_grad


@triton.jit
def _delta(o_ptr, do_ptr, delta_ptr, head_dim, o_row_stride, do_row_stride, BLOCK_D: tl.constexpr,
           FAULT: tl.constexpr):
    pid = tl.program_id(0)
    offsets = tl.arange(0, BLOCK_D)
    mask = offsets < head_dim
    if FAULT == "no mask":
        mask = offsets < BLOCK_D
    do_stride = o_row_stride if FAULT == "one stride" else do_row_stride
    o = tl.load(o_ptr + pid * o_row_stride + offsets, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(do_ptr + pid * do_stride + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(delta_ptr + pid, tl.sum(o * do, axis=0))


def bound(kernel, fault: str):
    """``kernel[grid](...)`` with this fault baked in, as the checkers launch a student's kernel."""
    class Bound:
        def __getitem__(self, grid):
            return lambda *args, **kw: kernel[grid](*args, FAULT=fault, **kw)
    return Bound()


def test_delta_checker_passes_the_right_kernel(capsys):
    checks.check_delta_kernel(bound(_delta, "none"))
    assert capsys.readouterr().out.startswith("PASS ")


@pytest.mark.parametrize("fault", ["one stride", "no mask"])
def test_delta_checker_fails_wrong_kernels(fault):
    with pytest.raises(check.CheckFailure, match="differ"):
        checks.check_delta_kernel(bound(_delta, fault))


SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)


@triton.jit
def _gelu(z):
    a = SQRT_2_OVER_PI * (z + 0.044715 * z * z * z)
    return z / (1.0 + tl.exp(-2.0 * a))


@triton.jit
def _gelu_backward(dy_ptr, x_ptr, bias_ptr, dx_ptr, n_elements, n_cols, p, seed, BLOCK_SIZE: tl.constexpr,
                   FAULT: tl.constexpr):
    pid = tl.program_id(0)
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    b = tl.load(bias_ptr + offsets % n_cols, mask=mask).to(tl.float32)
    dy = tl.load(dy_ptr + offsets, mask=mask).to(tl.float32)
    if FAULT == "gelu not its derivative":
        g = _gelu(x + b)
    else:
        g = gelu_grad(x + b, True)
    if FAULT == "mask repeats every tile":
        r = tl.rand(seed, tl.arange(0, BLOCK_SIZE))
    else:
        r = tl.rand(seed, offsets)
    scale = 1.0 if FAULT == "no rescale" else 1.0 / (1.0 - p)
    dx = dy * g * scale
    if FAULT != "no mask":
        dx = tl.where(r >= p, dx, 0.0)
    tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def make_gelu_backward(fault: str):
    return bound(_gelu_backward, fault)


def test_gelu_backward_checker_passes_the_right_kernel(capsys):
    checks.check_gelu_backward_kernel(make_gelu_backward("none"))
    assert capsys.readouterr().out.startswith("PASS ")


@pytest.mark.parametrize("fault, words", [
    ("gelu not its derivative", "derivative"),
    ("no rescale", "1 / \\(1 - p\\)"),
    ("no mask", "regenerate the forward's mask"),
    ("mask repeats every tile", "same \\(seed, flat offset\\)"),
])
def test_gelu_backward_checker_names_each_fault(fault, words):
    with pytest.raises(check.CheckFailure, match=words):
        checks.check_gelu_backward_kernel(make_gelu_backward(fault))
