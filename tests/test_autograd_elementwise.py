"""Chapter 11: the bias + GELU (+ dropout) backward kernel and its autograd Function."""

import pytest
import torch

import course_utils as cu
from course_utils import check
from course_utils.autograd import elementwise as AG
from course_utils.kernels import gelu_backward as gb
from course_utils.tuned import elementwise as TE

DTYPES = cu.env.supported_dtypes()
SHAPES = [(1, 1), (7, 13), (37, 129), (3, 5, 70)]


def _ref(dy, x, b, approximate, keep=None, p=0.0):
    return gb.bias_gelu_backward_ref(dy.double(), x.double(), b.double(), keep=keep, p=p, approximate=approximate)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_backward_kernel_matches_float64_autograd(shape, approximate, dtype):
    x = check.randn(shape, dtype, scale=3.0, outliers=0.05, outlier_scale=1e4)
    b = check.randn(shape[-1:], dtype)
    dy = check.randn(shape, dtype)
    out = check.Guarded(shape, dtype)
    dx, db = gb.bias_gelu_backward_teaching(dy, x, b, approximate=approximate, dx=out.tensor)
    out.check("dx")
    rx, rb = _ref(dy, x, b, approximate)
    check.compare("dx", dx, rx, dtype=dtype)
    # db sums up to n_rows values of dz: its rounding grows with the row count
    atol, rtol = check.tolerance(dtype)
    rows = x.numel() // shape[-1]
    check.compare("db", db, rb, dtype=dtype, atol=atol * rows, rtol=rtol * 4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dropout_mask_is_regenerated_not_stored(dtype):
    x, b, dy = check.randn((33, 257), dtype), check.randn((257,), dtype), check.randn((33, 257), dtype)
    p, seed = 0.3, 987654
    keep = TE.dropout_keep_mask(x.shape, p, seed, device=x.device)
    y = TE.bias_gelu_dropout(x, b, p, seed)
    assert bool((y[~keep.bool()] == 0).all()), "the forward drops what the reference mask drops"
    dx, db = gb.bias_gelu_backward_teaching(dy, x, b, p=p, seed=seed)
    rx, rb = _ref(dy, x, b, "tanh", keep=keep, p=p)
    check.compare("dx with dropout", dx, rx, dtype=dtype)
    atol, rtol = check.tolerance(dtype)
    check.compare("db with dropout", db, rb, dtype=dtype, atol=atol * 33, rtol=rtol * 4)
    other, _ = gb.bias_gelu_backward_teaching(dy, x, b, p=p, seed=seed + 1)
    assert not torch.equal(other, dx), "another seed must give another mask"


def test_huge_inputs_give_exact_limits_not_nan():
    x = torch.tensor([[-1e30, -50.0, 50.0, 1e30, 3e38]], device=cu.DEVICE)
    b = torch.zeros(5, device=cu.DEVICE)
    dx, _ = gb.bias_gelu_backward_teaching(torch.ones_like(x), x, b)
    assert dx.tolist() == [[0.0, 0.0, 1.0, 1.0, 1.0]]


def test_autograd_function_against_float64_autograd():
    x = check.randn((19, 45)).requires_grad_(True)
    b = check.randn((45,)).requires_grad_(True)
    dy = check.randn((19, 45))
    y = AG.bias_gelu_dropout(x, b, 0.25, 42)
    y.backward(dy)
    keep = TE.dropout_keep_mask(x.shape, 0.25, 42, device=x.device)
    x64, b64 = x.detach().double().requires_grad_(True), b.detach().double().requires_grad_(True)
    y64 = torch.where(keep.bool(), torch.nn.functional.gelu(x64 + b64, approximate="tanh") / 0.75, 0.0)
    y64.backward(dy.double())
    check.compare("y", y, y64)
    check.compare("dx", x.grad, x64.grad)
    check.compare("db", b.grad, b64.grad, atol=1e-4)


def test_bias_gelu_without_dropout():
    x = check.randn((8, 31)).requires_grad_(True)
    b = check.randn((31,)).requires_grad_(True)
    AG.bias_gelu(x, b).sum().backward()
    x64, b64 = x.detach().double().requires_grad_(True), b.detach().double().requires_grad_(True)
    torch.nn.functional.gelu(x64 + b64, approximate="tanh").sum().backward()
    check.compare("dx", x.grad, x64.grad)
    check.compare("db", b.grad, b64.grad, atol=1e-4)


def test_empty_input_returns_empty_without_launch():
    x = torch.empty((0, 16), device=cu.DEVICE)
    dx, db = gb.bias_gelu_backward_teaching(x, x, torch.zeros(16, device=cu.DEVICE))
    assert dx.shape == (0, 16) and torch.equal(db, torch.zeros(16, device=cu.DEVICE))


@pytest.mark.parametrize("bad, message", [
    (lambda x, b: (x[:3], x, b), "shape"),
    (lambda x, b: (x, x, b[:3]), "bias must be 1-D"),
    (lambda x, b: (x.int(), x, b), "float32, float16 or bfloat16"),
    (lambda x, b: (x[:, ::2], x[:, ::2], b[:3]), "dense in memory"),  # a slice with gaps (a transpose is fine)
    (lambda x, b: (x, x.t().contiguous().t(), b), "dy must have x's strides"),
])
def test_bad_inputs_raise_clear_errors(bad, message):
    x = check.randn((6, 6))
    b = check.randn((6,))
    with pytest.raises((ValueError, TypeError), match=message):
        gb.bias_gelu_backward_teaching(*bad(x, b))
    with pytest.raises(ValueError, match="dropout probability"):
        gb.bias_gelu_backward_teaching(x, x, b, p=1.0)


def test_offsets_are_int64_past_2_31():
    # The flat index row * n_cols + col of the last element of a (2^20 + 1) x 2^11 tensor passes 2^31:
    # the kernel widens rows to int64 before the product (checked here on the arithmetic itself).
    n_rows, n_cols = 2**20 + 1, 2**11
    last = torch.tensor(n_rows - 1, dtype=torch.int64) * n_cols + (n_cols - 1)
    assert int(last) > 2**31 and int(last) == (n_rows - 1) * n_cols + n_cols - 1
    assert int(torch.tensor(n_rows - 1, dtype=torch.int32) * n_cols) < 0, "int32 would wrap"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_past_2_31_elements_on_gpu():
    n_rows, n_cols = 2**20 + 3, 2**11
    x = torch.zeros((n_rows, n_cols), device="cuda", dtype=torch.bfloat16)
    x[-1, -1] = 1.0
    b = torch.zeros(n_cols, device="cuda", dtype=torch.bfloat16)
    dx, db = gb.bias_gelu_backward_teaching(torch.ones_like(x), x, b)
    assert float(dx[-1, -1]) == pytest.approx(1.0829, abs=1e-2) and float(dx[0, 0]) == 0.5
    del x, dx
