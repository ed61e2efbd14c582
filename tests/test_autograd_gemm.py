"""Chapter 9's GEMM + bias + GELU as an autograd Function: gradients against float64 autograd."""

import pytest
import torch

import course_utils as cu
from course_utils import check
from course_utils.autograd import gemm as AG
from course_utils.autograd import registry


def _ref(x, w, b):
    return torch.nn.functional.gelu(x @ w.T + b, approximate="tanh")


@pytest.mark.parametrize("shape", [(1, 16, 8), (37, 45, 29), (2, 9, 33, 17)], ids=str)
def test_gradients_match_float64_autograd(shape):
    *lead, k, n = shape
    dtype = torch.float32
    x = check.randn((*lead, k), dtype).requires_grad_(True)
    w = (check.randn((n, k), dtype) * k**-0.5).requires_grad_(True)
    b = check.randn((n,), dtype).requires_grad_(True)
    y = AG.linear_gelu(x, w, b)
    dy = check.randn(y.shape, dtype)
    got = torch.autograd.grad(y, (x, w, b), dy)
    args64 = [t.detach().double().requires_grad_(True) for t in (x, w, b)]
    y64 = _ref(*args64)
    want = torch.autograd.grad(y64, args64, dy.double())
    # tl.dot on a GPU may round float32 through TF32; the interpreter multiplies in float32
    atol, rtol = cu.pick(gpu=(2e-2, 2e-2), cpu=(1e-4, 1e-4))
    check.compare("y", y, y64, atol=atol, rtol=rtol)
    for name, g, r in zip(("dx", "dw", "db"), got, want):
        check.compare(name, g, r, atol=atol * max(1, k // 8), rtol=rtol)


def test_registry_can_use_the_gemm_epilogue():
    ops = registry.course_ops(gemm_epilogue=True)
    assert ops.linear_gelu is AG.linear_gelu
    assert registry.course_ops().linear_gelu is not AG.linear_gelu


def test_bad_weight_shape_is_refused():
    with pytest.raises(ValueError, match="out_features, in_features"):
        AG.linear_gelu(check.randn((4, 8)), check.randn((8, 5)), check.randn((8,)))
