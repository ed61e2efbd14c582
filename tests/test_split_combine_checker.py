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
(ANSWER, NO_MAX, NO_DIVISION, TIMES_L, RUNNING_MAX, MEAN, M_NOT_LSE, RUNNING_MAX_GUARDED, ZERO_MAX, MAX_SKIPS_FIRST,
 ACC_16, EXP2, EMPTY_WEIGHS_ONE, BY_SPLITS, SKIP_LAST, CHUNK0, O_STRIDE, EXTRA_CHUNK) = (
    tl.constexpr(i) for i in range(18))


@triton.jit
def _combine(o_ptr, m_ptr, lse_ptr, out_ptr, rows, splits, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
             FORM: tl.constexpr):
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = offs_r < rows
    total = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, HEAD_DIM], dtype=tl.float32)
    if FORM == ACC_16:
        acc = tl.zeros([BLOCK_R, HEAD_DIM], dtype=out_ptr.dtype.element_ty)
    big = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    if FORM == ZERO_MAX:
        big = tl.zeros([BLOCK_R], dtype=tl.float32)
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
        first = 0
        if FORM == MAX_SKIPS_FIRST:
            first = 1
        last = splits
        if FORM == SKIP_LAST:
            last = splits - 1
        if FORM == EXTRA_CHUNK:
            last = splits + 1
        stride = rows   # of the chunk dimension
        if FORM == CHUNK0:
            stride = 0
        for c in range(first, last):
            if FORM == M_NOT_LSE:
                x = tl.load(m_ptr + c * rows + offs_r, mask=ok, other=float("-inf"))
            else:
                x = tl.load(lse_ptr + c * stride + offs_r, mask=ok, other=float("-inf"))
            big = tl.maximum(big, x)
        big = tl.where(big == float("-inf"), 0.0, big)
        if FORM == NO_MAX:
            big = tl.zeros([BLOCK_R], dtype=tl.float32)
        for c in range(0, last):
            if FORM == M_NOT_LSE:
                x = tl.load(m_ptr + c * rows + offs_r, mask=ok, other=float("-inf"))
            else:
                x = tl.load(lse_ptr + c * stride + offs_r, mask=ok, other=float("-inf"))
            o_at = (c * stride + offs_r)[:, None] * HEAD_DIM + offs_d[None, :]
            if FORM == O_STRIDE:
                o_at = c * rows + offs_r[:, None] * HEAD_DIM + offs_d[None, :]
            o_c = tl.load(o_ptr + o_at, mask=ok[:, None], other=0.0)
            w = tl.exp(x - big)
            if FORM == EXP2:
                w = tl.exp2(x - big)
            if FORM == EMPTY_WEIGHS_ONE:
                w = tl.where(x == float("-inf"), 1.0, w)
            if FORM == MEAN:
                w = tl.full([BLOCK_R], 1.0, dtype=tl.float32)
            total += w
            acc += (w[:, None] * o_c).to(acc.dtype)
    if FORM == NO_DIVISION:
        out = acc
    elif FORM == TIMES_L:
        out = acc * total[:, None]
    elif FORM == BY_SPLITS:
        out = acc / splits
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
            o2, m2, lse2 = sc.partials(q, k, v, splits, causal, last_first, shift=sc.SHIFT)   # the same attention
            assert torch.allclose(o2, o) and torch.allclose(lse2, lse + sc.SHIFT) and torch.allclose(m2, m + sc.SHIFT)


def _case_partials(what):
    b, h, n, d, splits, causal, _, q_scale, last_first = next(c for c in sc.cases() if c[6] == what)
    q, k, v = sc._qkv(b, h, n, d, torch.float16, q_scale, what)
    shift = sc.SHIFT if what == sc.SHIFTED else 0.0
    return sc.partials(q, k, v, splits, causal, last_first, shift), A.attention_ref(
        q.double(), k.double(), v.double(), causal=causal).reshape(b * h * n, d)


def test_the_exp_range_cases_hold_their_property():
    """SHIFTED: every exp(lse_c) underflows float32 (below exp(-103.3)); NEEDLE: one chunk's lse_c passes every
    other's by more than float32's exp range (88.7), the first chunk in one head and the last in the other;
    CANCEL: chunk outputs near +-DRIFT on axis 0, the output near 0, each row's own (its rounding too)."""
    (o, m, lse), _ = _case_partials(sc.SHIFTED)
    assert bool((lse < -104).all())
    (o, m, lse), _ = _case_partials(sc.NEEDLE)
    top2 = lse.topk(2, dim=0).values
    assert bool((top2[0] - top2[1] > 89).all())
    assert set(lse.argmax(0).tolist()) == {0, lse.shape[0] - 1}
    (o, m, lse), out = _case_partials(sc.CANCEL)
    assert bool((o[..., 0].abs() > sc.DRIFT - 5).all()) and bool((out[:, 0].abs() < 5).all())
    assert o[0, :, 0].unique().numel() > o.shape[1] // 2   # with q = 0 a head's rows had one chunk output


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
    (EXP2, ["exp2(lse_c - M)"]),
    (EMPTY_WEIGHS_ONE, ["empty chunk", "gets a weight"]),
    (BY_SPLITS, ["divided by the number of chunks S"]),
    (SKIP_LAST, ["one chunk is left out"]),
    (CHUNK0, ["each load reads chunk 0"]),
    (O_STRIDE, ["chunk stride is rows * HEAD_DIM"]),
], ids=["no-max", "no-division", "times-l", "running-max-nan", "mean", "m-not-lse", "exp2", "empty-chunk-weighed",
        "by-splits", "loop-skips-a-chunk", "chunk-0-always", "o-stride-rows"])
def test_each_fault_is_named(form, words):
    with pytest.raises(check.CheckFailure) as e:
        sc.check_split_combine(_exercise(form), "combine")
    for w in words:
        assert w in str(e.value), str(e.value)


@pytest.mark.parametrize("form, what, words", [
    (ZERO_MAX, sc.SHIFTED, ["scores shifted by -200", "max starts at 0"]),
    (MAX_SKIPS_FIRST, sc.NEEDLE, ["outscoring the rest", "skip a chunk"]),
    (ACC_16, sc.CANCEL, ["values +100 then -100", "16-bit dtype"]),
], ids=["max-from-zero", "max-skips-a-chunk", "16-bit-accumulator"])
def test_each_exp_range_case_names_its_fault(form, what, words, monkeypatch):
    """Kernels that the usual cases pass (the 16-bit accumulator every time, a max from 0 or one that skips a
    chunk most times, failing by chance on large scores only): the case made for each fails it, alone."""
    only = [c for c in sc.cases() if c[6] == what]
    monkeypatch.setattr(sc, "cases", lambda: only)
    with pytest.raises(check.CheckFailure) as e:
        sc.check_split_combine(_exercise(form), "combine")
    for w in words:
        assert w in str(e.value), str(e.value)


@pytest.mark.skipif(cu.on_gpu(), reason="loads are recorded under the interpreter only")
def test_a_loop_over_one_chunk_too_many_is_named():
    with pytest.raises(check.CheckFailure, match=r"exactly one chunk more") as e:
        sc.check_split_combine(_exercise(EXTRA_CHUNK), "combine")
    assert "S + 1 times" in str(e.value) and "pass mask=" not in str(e.value), str(e.value)


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
