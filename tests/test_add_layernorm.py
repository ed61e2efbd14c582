"""Residual add + LayerNorm (course_utils/kernels/add_layernorm.py): forward and backward against
float64 autograd, on odd sizes, strided rows, mixed dtypes, several programs' partial sums, and NaN-
poisoned outputs (every torch.empty the launchers make starts as NaN)."""

import pytest
import torch
import torch.nn.functional as F

from course_utils import check
from course_utils.kernels import add_layernorm as K


def _ref64(x, r, w, b, eps, dy, ds):
    x, r, w, b = (t.detach().double().requires_grad_(True) for t in (x, r, w, b))
    s = x + r
    y = F.layer_norm(s, (s.shape[-1],), w, b, eps)
    grads = torch.autograd.grad((y, s), (x, r, w, b), (dy.double(), ds.double() if ds is not None else
                                                       torch.zeros_like(s)))
    return y, s, grads


@pytest.mark.parametrize("shape,dtypes,kw", [
    ((1, 1), (torch.float32, torch.float32), {}),
    ((7, 37), (torch.float32, torch.float32), {}),
    ((3, 5, 100), (torch.float16, torch.float32), {"programs": 2, "rows": 2}),   # partial sums of 2 programs
    ((13, 33), (torch.float16, torch.float16), {"programs": 3}),
], ids=str)
def test_forward_and_backward_match_float64(nan_empty, shape, dtypes, kw):
    xd, rd = dtypes
    x = check.randn(shape, xd, scale=2.0, offset=0.5)
    r = check.randn(shape, rd)
    n = shape[-1]
    w, b = check.randn((n,), rd), check.randn((n,), rd)
    y, s, mean, rstd = K.add_layer_norm_teaching(x, r, w, b, 1e-5)
    dy = check.randn(shape, s.dtype)
    ds = check.randn(shape, s.dtype)
    dx, dw, db = K.add_layer_norm_backward_teaching(dy, ds, s, w, mean, rstd, **kw)
    y64, s64, (gx, gr, gw, gb) = _ref64(x, r, w, b, 1e-5, dy, ds)
    assert s.dtype == torch.promote_types(xd, rd) and y.dtype == s.dtype
    assert torch.equal(gx, gr)   # both inputs of the add get the same gradient
    check.compare("s", s, s64)
    # the kernel normalizes the stream as stored (s rounded to its dtype, what the backward will read): so does
    # the reference of y (a float16 s is up to 2^-11 relative off the exact sum, which LayerNorm scales by rstd)
    y_stored = F.layer_norm(s64.detach().to(s.dtype).double(), (n,), w.double(), b.double(), 1e-5)
    check.compare("y", y, y_stored, atol=1e-3 if s.dtype == torch.float16 else 1e-4)
    check.compare("dx (= dresidual)", dx, gx, atol=5e-3 if s.dtype == torch.float16 else 1e-4, rtol=1e-2)
    tol = 2e-3 * shape[0] * (shape[1] if len(shape) == 3 else 1)
    check.compare("dw", dw, gw, atol=tol, rtol=1e-2)
    check.compare("db", db, gb, atol=tol, rtol=1e-2)


def test_no_residual_gradient_and_strided_rows(nan_empty):
    base = check.randn((6, 64))
    x = base[:, 5:45]            # rows 64 apart, 40 columns: read in place
    r = check.randn((6, 40))
    w, b = check.randn((40,)), check.randn((40,))
    y, s, mean, rstd = K.add_layer_norm_teaching(x, r, w, b, 1e-5)
    dy = check.randn((6, 40))
    dx, dw, db = K.add_layer_norm_backward_teaching(dy, None, s, w, mean, rstd)
    y64, s64, (gx, _, gw, gb) = _ref64(x, r, w, b, 1e-5, dy, None)
    check.compare("y", y, y64, atol=1e-4)
    for name, got, want in (("dx", dx, gx), ("dw", dw, gw), ("db", db, gb)):
        check.compare(name, got, want, atol=1e-4, rtol=1e-3)


def test_empty_input_launches_nothing():
    x = torch.empty(0, 8)
    w = torch.ones(8)
    y, s, mean, rstd = K.add_layer_norm_teaching(x, x, w, w)
    assert y.shape == s.shape == (0, 8)
    dx, dw, db = K.add_layer_norm_backward_teaching(y, None, s, w, mean, rstd)
    assert dx.shape == (0, 8) and torch.equal(dw, torch.zeros(8))


@pytest.mark.parametrize("args,err,match", [
    (lambda x, w: (x, x[:, :3], w, w), ValueError, "residual must have shape"),
    (lambda x, w: (x, x, w[:3], w), ValueError, "weight must be a contiguous 1-D"),
    (lambda x, w: (x, x, w, w[:3]), ValueError, "bias must have shape"),
    (lambda x, w: (x.long(), x, w, w), TypeError, "float32, float16 or bfloat16"),
    (lambda x, w: (x, x, w, None), ValueError, "bias is required"),
], ids=["residual", "weight", "bias", "dtype", "no bias"])
def test_bad_inputs_say_what_was_expected(args, err, match):
    x, w = torch.randn(4, 8), torch.randn(8)
    with pytest.raises(err, match=match):
        K.add_layer_norm_teaching(*args(x, w))


def test_too_wide_rows_are_refused():
    with pytest.raises(ValueError, match="at most"):
        K.add_layer_norm_teaching(torch.zeros(1, K.MAX_BLOCK_N + 1), torch.zeros(1, K.MAX_BLOCK_N + 1),
                                  torch.zeros(K.MAX_BLOCK_N + 1), torch.zeros(K.MAX_BLOCK_N + 1))


@pytest.mark.parametrize("low", [torch.float16, torch.float32], ids=str)
def test_dx_in_the_branch_dtype_is_the_cast_of_dx_bit_for_bit(nan_empty, low):
    """LOW: the kernel stores dx a second time in the branch's dtype from the same registers; that is exactly what
    casting the stored float32 dx gives, on a ragged tile of rows split over several programs."""
    shape = (11, 50)
    x, r = check.randn(shape, torch.float16, scale=2.0), check.randn(shape)
    w, b = check.randn((50,)), check.randn((50,))
    _, s, mean, rstd = K.add_layer_norm_teaching(x, r, w, b, 1e-5)
    dy, ds = check.randn(shape), check.randn(shape)
    want = K.add_layer_norm_backward_teaching(dy, ds, s, w, mean, rstd, programs=3, rows=2)
    dx, dx_low, dw, db = K.add_layer_norm_backward_teaching(dy, ds, s, w, mean, rstd, programs=3, rows=2,
                                                            low_dtype=low)
    assert dx_low.dtype == low and torch.equal(dx_low, dx.to(low))
    for name, got, ref in (("dx", dx, want[0]), ("dw", dw, want[1]), ("db", db, want[2])):
        assert torch.equal(got, ref), name
