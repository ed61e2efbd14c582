"""Softmax backward (kernels/softmax_backward.py, tuned/softmax_backward.py) and SoftmaxFunction
against float64 autograd; small sizes under the interpreter, long rows and bf16 on a GPU."""

from __future__ import annotations

import pytest
import torch

from course_utils import check, env
from course_utils.kernels import softmax_backward as S
from course_utils.profile import count_launches
from course_utils.tuned import softmax_backward as TS

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _ref(x, dy, dim=-1):
    xd = x.double().requires_grad_()
    y = torch.softmax(xd, dim)
    return y, torch.autograd.grad(y, xd, dy.double())[0]


def _close(what, got, want, dtype):
    err = float((got.double().cpu() - want.cpu()).abs().max() / want.abs().max().clamp_min(1e-3))
    assert err <= TOL[dtype], f"{what}: relative error {err:.2e}"


@pytest.mark.parametrize("dtype", env.supported_dtypes())
@pytest.mark.parametrize("shape", [(1, 1), (7, 13), (40, 300), (3, 1000)])
def test_teaching_and_tuned_match_float64(dtype, shape):
    x = check.randn(shape, dtype, scale=3.0)
    dy = check.randn((shape[0], shape[1] + 2), dtype)[:, :shape[1]]  # strided rows
    y64, dx64 = _ref(x, dy)
    y = y64.to(dtype)
    dx64 = S.softmax_backward_ref(y.double(), dy.double())  # the formula on the rounded y (float64 autograd
    _close("teaching", S.softmax_backward_teaching(y, dy), dx64, dtype)  # agrees: test_softmax_function...)
    _close("tuned", TS.softmax_backward(y, dy), dx64, dtype)


def test_looped_long_rows(monkeypatch):
    monkeypatch.setattr(TS, "MAX_BLOCK", 256)
    monkeypatch.setattr(TS, "LOOP_BLOCK", 64)
    x, dy = check.randn((5, 1001)), check.randn((5, 1001))
    assert TS.plan(5, 1001)[0] == "looped"
    y64, dx64 = _ref(x, dy)
    _close("looped", TS.softmax_backward(y64.float(), dy), dx64, torch.float32)


@pytest.mark.parametrize("dim", [-1, 1])
def test_softmax_function_matches_autograd(dim):
    x, dy = check.randn((4, 6, 33), scale=2.0), check.randn((4, 6, 33))
    y64, dx64 = _ref(x, dy, dim)
    xa = x.clone().requires_grad_()
    y = TS.softmax_autograd(xa, dim)
    _close("y", y, y64, torch.float32)
    (dx,) = torch.autograd.grad(y, xa, dy)
    _close("dx", dx, dx64, torch.float32)


def test_one_launch_empty_and_errors():
    y, dy = torch.softmax(check.randn((9, 77)), -1), check.randn((9, 77))
    TS.softmax_backward(y, dy)
    assert count_launches(TS.softmax_backward, y, dy).total == 1
    assert count_launches(S.softmax_backward_teaching, y, dy).total == 1
    e = torch.empty(0, 5, device=env.DEVICE)
    assert TS.softmax_backward(e, e).shape == (0, 5) and count_launches(TS.softmax_backward, e, e).total == 0
    with pytest.raises(ValueError, match="dy must have the shape and dtype of y"):
        TS.softmax_backward(y, dy[:3])
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        TS.softmax_backward(y.double(), dy.double())
    with pytest.raises(AttributeError):
        S.no_such_name  # noqa: B018
    assert not hasattr(S, "SoftmaxFunction") and not hasattr(S, "softmax_backward")   # tuned shelf only


@pytest.mark.gpu
@pytest.mark.skipif(not env.on_gpu(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1024, 5000, 16384, 20000, 100003])
def test_gpu_rows_of_every_length(dtype, n):
    x, dy = check.randn((64, n), dtype, scale=3.0), check.randn((64, n), dtype)
    y = torch.softmax(x.double(), -1).to(dtype)
    _close("tuned", TS.softmax_backward(y, dy), S.softmax_backward_ref(y.double(), dy.double()), dtype)
