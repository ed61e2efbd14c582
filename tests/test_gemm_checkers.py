"""The chapter 9 checkers pass correct kernels and fail the usual wrong ones, naming the fault."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import course_utils as cu
from course_utils import check
from course_utils.checkers import gemm as cg
from course_utils.kernels.elementwise import gelu_math

# tl.constexpr, so the compiled (GPU) kernel may read them as globals
OK, NO_K_MASK, FP16_ACC, BIAS_ROWS, GELU_FIRST, NO_STRIDES = (tl.constexpr(i) for i in range(6))
BLOCK = 16 if not cu.on_gpu() else 32


@triton.jit
def _buggy_linear(a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  EPILOGUE: tl.constexpr, BUG: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    if BUG == NO_STRIDES:   # assumes row-major operands
        stride_ak = 1
        stride_bn = 1
        stride_am = K
        stride_bk = N
    if BUG == FP16_ACC:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float16)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        mask_k = k < K
        if BUG == NO_K_MASK:
            mask_k = k >= 0
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + k[None, :] * stride_ak,
                    mask=(offs_m[:, None] < M) & mask_k[None, :], other=0.0)
        b = tl.load(b_ptr + k[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                    mask=mask_k[:, None] & (offs_n[None, :] < N), other=0.0)
        if BUG == FP16_ACC:
            acc = (acc + tl.dot(a, b)).to(tl.float16)
        else:
            acc = tl.dot(a, b, acc)
    acc = acc.to(tl.float32)
    if EPILOGUE:
        if BUG == BIAS_ROWS:
            bias = tl.load(bias_ptr + offs_m, mask=offs_m < M, other=0.0).to(tl.float32)
            acc = gelu_math(acc + bias[:, None], True)
        elif BUG == GELU_FIRST:
            bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
            acc = gelu_math(acc, True) + bias[None, :]
        else:
            bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
            acc = gelu_math(acc + bias[None, :], True)
    tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def _launcher(bug, epilogue, launches=1):
    def run(a, b, bias=None):
        M, K = a.shape
        N = b.shape[1]
        c = torch.empty((M, N), dtype=a.dtype, device=a.device)
        grid = (triton.cdiv(M, BLOCK), triton.cdiv(N, BLOCK))
        for _ in range(launches):
            _buggy_linear[grid](a, b, c, bias if bias is not None else c, M, N, K,
                                a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                                BLOCK_M=BLOCK, BLOCK_N=BLOCK, BLOCK_K=BLOCK, EPILOGUE=epilogue, BUG=bug)
        return c

    if epilogue:
        return lambda x, w, b: run(x, w, b)
    return lambda a, b: run(a, b)


FP = (torch.float32,)


def test_correct_kernels_pass(capsys):
    cg.check_matmul(_launcher(OK, False))
    cg.check_linear_gelu(_launcher(OK, True))
    out = capsys.readouterr().out
    assert out.count("PASS") == 2


def test_the_courses_own_kernels_are_refused_as_the_answer_key():
    from course_utils.kernels import gemm as G
    for check_fn, fn in ((cg.check_matmul, lambda a, b: G.matmul_teaching(a, b)),
                         (cg.check_linear_gelu, lambda x, w, b: G.linear_gelu_teaching(x, w, b))):
        with pytest.raises(check.CheckFailure, match="course's own kernel"):
            check_fn(fn)


@pytest.mark.parametrize("bug, epilogue, dtypes, words", [
    (NO_K_MASK, False, FP, ["K mask"]),
    (NO_K_MASK, True, FP, ["K mask"]),
    (FP16_ACC, False, (torch.float16,), ["float32", "ccumulate"]),
    (BIAS_ROWS, True, FP, ["wrong axis"]),
    (GELU_FIRST, True, FP, ["GELU is applied before the bias"]),
    (NO_STRIDES, False, FP, ["transposed", "strides"]),
])
def test_wrong_kernels_fail_naming_the_fault(bug, epilogue, dtypes, words):
    fn = _launcher(bug, epilogue)
    checker = cg.check_linear_gelu if epilogue else cg.check_matmul
    with pytest.raises(check.CheckFailure) as e:
        checker(fn, dtypes=dtypes)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_two_launches_fail():
    with pytest.raises(check.CheckFailure, match="expected 1 launch\\(es\\) of your Triton kernel, counted 2"):
        cg.check_matmul(_launcher(OK, False, launches=2), dtypes=FP)


def test_unfinished_exercise_raises_not_implemented():
    def stub(a, b):
        raise NotImplementedError("Exercise 9.1: the tile loop")
    with pytest.raises(NotImplementedError, match="9.1"):
        cg.check_matmul(stub)


def test_wrong_shape_and_written_input_fail():
    with pytest.raises(check.CheckFailure, match="expected a"):
        cg.check_matmul(lambda a, b: torch.zeros(1, 1, device=a.device), dtypes=FP)

    def scribbles(a, b):
        c = _launcher(OK, False)(a, b)
        a.zero_()
        return c
    with pytest.raises(check.CheckFailure, match="changed its input"):
        cg.check_matmul(scribbles, dtypes=FP)
