"""Exercise 7.1's checker (split-KV combine) passes the exercise's answer, and a combine with a guarded running
max, and names each usual slip: one combine kernel, its slips picked by a constexpr."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import course_utils as cu
from course_utils import check
from course_utils.checkers import split_combine as sc
from course_utils.kernels import attention as A

# the forms of the combine kernel (constexpr globals: a @triton.jit function reads no other global)
ANSWER, NO_MAX, NO_DIVISION, TIMES_L, RUNNING_MAX, MEAN, M_NOT_LSE, RUNNING_MAX_GUARDED = (
    tl.constexpr(i) for i in range(8))


@triton.jit
def _combine(o_ptr, m_ptr, lse_ptr, out_ptr, rows, splits, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
             FORM: tl.constexpr):
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = offs_r < rows
    total = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, HEAD_DIM], dtype=tl.float32)
    big = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    if FORM == RUNNING_MAX or FORM == RUNNING_MAX_GUARDED:   # one pass, the max kept as it goes (chapter 6)
        for c in range(0, splits):
            x = tl.load(lse_ptr + c * rows + offs_r, mask=ok, other=float("-inf"))
            o_c = tl.load(o_ptr + (c * rows + offs_r)[:, None] * HEAD_DIM + offs_d[None, :], mask=ok[:, None],
                          other=0.0)
            new = tl.maximum(big, x)
            if FORM == RUNNING_MAX_GUARDED:
                use = tl.where(new == float("-inf"), 0.0, new)
            else:
                use = new
            alpha = tl.exp(big - use)
            w = tl.exp(x - use)
            total = total * alpha + w
            acc = acc * alpha[:, None] + w[:, None] * o_c
            big = new
    else:
        for c in range(0, splits):
            if FORM == M_NOT_LSE:
                x = tl.load(m_ptr + c * rows + offs_r, mask=ok, other=float("-inf"))
            else:
                x = tl.load(lse_ptr + c * rows + offs_r, mask=ok, other=float("-inf"))
            big = tl.maximum(big, x)
        big = tl.where(big == float("-inf"), 0.0, big)
        if FORM == NO_MAX:
            big = tl.zeros([BLOCK_R], dtype=tl.float32)
        for c in range(0, splits):
            if FORM == M_NOT_LSE:
                x = tl.load(m_ptr + c * rows + offs_r, mask=ok, other=float("-inf"))
            else:
                x = tl.load(lse_ptr + c * rows + offs_r, mask=ok, other=float("-inf"))
            o_c = tl.load(o_ptr + (c * rows + offs_r)[:, None] * HEAD_DIM + offs_d[None, :], mask=ok[:, None],
                          other=0.0)
            w = tl.exp(x - big)
            if FORM == MEAN:
                w = tl.full([BLOCK_R], 1.0, dtype=tl.float32)
            total += w
            acc += w[:, None] * o_c
    if FORM == NO_DIVISION:
        out = acc
    elif FORM == TIMES_L:
        out = acc * total[:, None]
    else:
        out = acc / total[:, None]
    tl.store(out_ptr + offs_r[:, None] * HEAD_DIM + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=ok[:, None])


def _exercise(form=ANSWER):
    def combine(o_part, m_part, lse_part, out):
        splits, rows, d = o_part.shape
        _combine[(triton.cdiv(rows, 16),)](o_part, m_part, lse_part, out, rows, splits, HEAD_DIM=d, BLOCK_R=16,
                                           FORM=form)
        return out
    return combine


@pytest.mark.parametrize("form", [ANSWER, RUNNING_MAX_GUARDED], ids=["two-pass", "running-max-guarded"])
def test_the_answer_passes(form, capsys):
    sc.check_split_combine(_exercise(form), "combine answer")
    assert "PASS combine answer" in capsys.readouterr().out


def test_the_partials_combine_to_attention():
    """partials() against attention, combined in float64 by the formula, chunks in either order."""
    q, k, v = (torch.randn(1, 2, 11, 4, dtype=torch.float64) for _ in range(3))
    for causal in (False, True):
        for splits, last_first in ((1, False), (3, True), (5, False), (13, True)):
            o, m, lse = sc.partials(q, k, v, splits, causal, last_first)
            big = lse.amax(0)
            w = torch.exp(lse - big)
            got = (o * w[..., None]).sum(0) / w.sum(0)[:, None]
            assert torch.allclose(got, A.attention_ref(q, k, v, causal=causal).reshape(-1, 4))
            assert bool((m <= lse).all()) and bool(torch.isinf(lse).any()) == (
                (causal and splits > 1) or (splits - 1) * -(-11 // splits) >= 11)   # a chunk past the last key


def test_the_pipeline_is_checked_too():
    def attention(q, k, v, causal=False, splits=1):
        o, m, lse = (t.float() for t in sc.partials(q, k, v, splits, causal))
        return _exercise()(o, m, lse, torch.empty(o.shape[1:], dtype=q.dtype, device=q.device)).view(q.shape)

    sc.check_split_combine(_exercise(), "combine", attention=attention)
    with pytest.raises(check.CheckFailure, match="split kernel and combine together"):
        sc.check_split_combine(_exercise(), "combine", attention=lambda q, k, v, causal, splits: torch.zeros_like(q))


@pytest.mark.parametrize("form, words", [
    (NO_MAX, ["max is not subtracted", "overflows"]),
    (NO_DIVISION, ["not divided by their total"]),
    (TIMES_L, ["multiplied by the total l"]),
    (RUNNING_MAX, ["first chunk is empty", "exp(-inf - -inf)"]),
    (MEAN, ["averaged with equal weights"]),
    (M_NOT_LSE, ["use m_c, the chunk's max, not lse_c"]),
], ids=["no-max", "no-division", "times-l", "running-max-nan", "mean", "m-not-lse"])
def test_each_fault_is_named(form, words):
    with pytest.raises(check.CheckFailure) as e:
        sc.check_split_combine(_exercise(form), "combine")
    for w in words:
        assert w in str(e.value), str(e.value)


@pytest.mark.skipif(cu.on_gpu(), reason="loads are recorded under the interpreter only")
def test_a_missing_load_mask_is_named():
    @triton.jit
    def _unmasked(o_ptr, m_ptr, lse_ptr, out_ptr, rows, splits, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr):
        offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        offs_d = tl.arange(0, HEAD_DIM)
        total = tl.zeros([BLOCK_R], dtype=tl.float32)
        acc = tl.zeros([BLOCK_R, HEAD_DIM], dtype=tl.float32)
        for c in range(0, splits):   # weights of 1: the load, not the numbers, is under test
            total += 1.0
            acc += tl.load(o_ptr + (c * rows + offs_r)[:, None] * HEAD_DIM + offs_d[None, :])
        tl.store(out_ptr + offs_r[:, None] * HEAD_DIM + offs_d[None, :], (acc / total[:, None]).to(
            out_ptr.dtype.element_ty), mask=offs_r[:, None] < rows)

    def combine(o_part, m_part, lse_part, out):
        splits, rows, d = o_part.shape
        _unmasked[(triton.cdiv(rows, 16),)](o_part, m_part, lse_part, out, rows, splits, HEAD_DIM=d, BLOCK_R=16)

    with pytest.raises(check.CheckFailure, match="outside its inputs"):
        sc.check_split_combine(combine, "combine")


def test_torch_and_the_course_are_refused():
    def in_torch(o_part, m_part, lse_part, out):
        w = torch.softmax(lse_part, dim=0)
        out.copy_((o_part * w[..., None]).sum(0))

    with pytest.raises(check.CheckFailure, match="ran in torch"):
        sc.check_split_combine(in_torch, "combine")
    with pytest.raises(check.CheckFailure, match="course"):
        sc.check_split_combine(lambda o, m, lse, out: A.flash_attention_teaching(o, m, lse), "answer key")


def test_the_stub_raises_not_implemented():
    @triton.jit
    def _stub(o_ptr, m_ptr, lse_ptr, out_ptr, rows, splits, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr):
        raise NotImplementedError("Exercise 7.1: replace this line with your code")

    def combine(o_part, m_part, lse_part, out):
        _stub[(1,)](o_part, m_part, lse_part, out, 1, 1, HEAD_DIM=16, BLOCK_R=16)

    with pytest.raises(NotImplementedError, match="Exercise 7.1"):
        sc.check_split_combine(combine, "stub")
