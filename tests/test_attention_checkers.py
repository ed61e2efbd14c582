"""The chapter 7 checker passes correct kernels and fails the usual wrong ones."""

from __future__ import annotations

import functools

import pytest
import torch
import triton
import triton.language as tl

import course_utils as cu
from course_utils import check
from course_utils.checkers import attention as ca
from course_utils.kernels import attention as A
from course_utils.tuned import attention as TA

# tl.constexpr, so the compiled (GPU) kernel may read them as globals
(OK, NO_KEY_MASK, UNSTABLE_EXP, NO_RESCALE, STRICT_CAUSAL, NO_CAUSAL, WRONG_STRIDE, NO_NORMALIZE, NO_Q_MASK,
 NO_KV_LOAD_MASK, NO_SCALE, SCALE_1_D, CAUSAL_NEXT_KEY, CAUSAL_LOOP_ONLY, NO_L_RESCALE, NORMALIZE_EACH_TILE,
 NORMALIZE_EACH_TILE_STOP, FILL_1E4, CAUSAL_LOCAL_KEYS) = (tl.constexpr(i) for i in range(19))


@triton.jit
def _buggy_attn(q_ptr, k_ptr, v_ptr, o_ptr, stride_h, stride_n, stride_kn, n, sm_scale,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                CAUSAL: tl.constexpr, BUG: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q_mask = offs_m[:, None] < n
    if BUG == NO_Q_MASK:   # the padded query rows of the last tile loaded too (never stored: right numbers)
        q_mask = offs_m[:, None] >= 0
    q = tl.load(q_ptr + bh * stride_h + offs_m[:, None] * stride_n + offs_d[None, :], mask=q_mask, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    hi = n
    if CAUSAL and (BUG == CAUSAL_LOOP_ONLY or BUG == NORMALIZE_EACH_TILE_STOP):
        hi = tl.minimum(n, (pid_m + 1) * BLOCK_M)   # the key loop stops after the tile's last query
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_mask = cols[:, None] < n
        if BUG == NO_KV_LOAD_MASK:   # the padded keys loaded, then dropped from the softmax by `keep` below
            kv_mask = cols[:, None] >= 0
        k = tl.load(k_ptr + bh * stride_h + cols[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + bh * stride_h + cols[:, None] * stride_n + offs_d[None, :], mask=kv_mask, other=0.0)
        if BUG == NO_SCALE:
            s = tl.dot(q, tl.trans(k))
        elif BUG == SCALE_1_D:
            s = tl.dot(q, tl.trans(k)) * (sm_scale * sm_scale)
        else:
            s = tl.dot(q, tl.trans(k)) * sm_scale
        keep = cols[None, :] < n
        if BUG == NO_KEY_MASK:
            keep = cols[None, :] >= 0
        if CAUSAL:
            if BUG == STRICT_CAUSAL:
                keep = keep & (offs_m[:, None] > cols[None, :])
            elif BUG == CAUSAL_NEXT_KEY:
                keep = keep & (offs_m[:, None] + 1 >= cols[None, :])
            elif BUG == CAUSAL_LOCAL_KEYS:   # the key's offset within its tile, not its position
                keep = keep & (offs_m[:, None] >= offs_n[None, :])
            elif BUG != NO_CAUSAL and BUG != CAUSAL_LOOP_ONLY:
                keep = keep & (offs_m[:, None] >= cols[None, :])
        if BUG == FILL_1E4:   # a finite stand-in for -inf
            s = tl.where(keep, s, -1e4)
        else:
            s = tl.where(keep, s, float("-inf"))
        if BUG == UNSTABLE_EXP:
            p = tl.exp(s)
            l_i += tl.sum(p, 1)
            acc += tl.dot(p.to(v.dtype), v)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            if BUG == NO_L_RESCALE:
                l_i = l_i + tl.sum(p, 1)
            else:
                l_i = l_i * alpha + tl.sum(p, 1)
            if BUG == NO_RESCALE:
                acc += tl.dot(p.to(v.dtype), v)
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            if BUG == NORMALIZE_EACH_TILE or BUG == NORMALIZE_EACH_TILE_STOP:
                acc = acc / l_i[:, None]
            m_i = m_new
    if BUG != NO_NORMALIZE:
        acc = acc / l_i[:, None]
    tl.store(o_ptr + bh * stride_h + offs_m[:, None] * stride_n + offs_d[None, :], acc.to(o_ptr.dtype.element_ty),
             mask=offs_m[:, None] < n)


def buggy(q, k, v, causal=False, out=None, bug=OK):
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    b, h, n, d = q.shape
    out = torch.empty_like(q) if out is None else out
    kn = 1 if bug == WRONG_STRIDE else d
    _buggy_attn[(triton.cdiv(n, 16), b * h)](q, k, v, out, n * d, d, kn, n, d ** -0.5,
                                             HEAD_DIM=d, BLOCK_M=16, BLOCK_N=16, CAUSAL=causal,
                                             BUG=getattr(bug, "value", bug))
    return out


def test_reference_kernels_pass(capsys):
    ca.check_attention(functools.partial(buggy, bug=OK), "buggy harness, no bug")
    ca.check_attention(functools.partial(buggy, bug=OK), "buggy harness, no bug", causal=True)
    out = capsys.readouterr().out
    assert out.count("PASS") == 2 and "causal mask" in out


@pytest.mark.parametrize("answer, says", [
    (lambda q, k, v, causal=False: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal),
     "ran in torch"),                                      # issue 17: SDPA in chapter 7's launcher
    (lambda q, k, v, causal=False: TA.flash_attention(q, k, v, causal=causal), "the course's"),
    (lambda q, k, v, causal=False: A.flash_attention_teaching(q, k, v, causal=causal), "the course's"),
])
def test_the_answer_key_is_not_an_answer(answer, says):
    with pytest.raises(check.CheckFailure, match=says):
        ca.check_attention(answer, "answer key", causal=True)


@pytest.mark.parametrize("bug,causal,pattern", [
    (NO_KEY_MASK, False, "keys past seq in the last key tile are not masked"),
    (UNSTABLE_EXP, False, "large-magnitude|offset"),
    (NO_RESCALE, False, "accumulator is not rescaled"),
    (NO_RESCALE, True, "accumulator is not rescaled"),
    (NO_L_RESCALE, False, "row sum l is not rescaled"),
    (NORMALIZE_EACH_TILE, False, "divided by l inside the key loop"),
    (NORMALIZE_EACH_TILE_STOP, True, "divided by l inside the key loop"),
    (STRICT_CAUSAL, True, "causal mask drops the diagonal"),
    (NO_CAUSAL, True, "causal mask is missing"),
    (CAUSAL_NEXT_KEY, True, "see the next key"),
    (CAUSAL_LOOP_ONLY, True, "causal mask is missing"),
    (NO_SCALE, False, "scores are not scaled"),
    (NO_SCALE, True, "scores are not scaled"),
    (SCALE_1_D, False, "scaled by 1/head_dim"),
    (WRONG_STRIDE, False, "differ"),
    (NO_NORMALIZE, False, "never divided by the row sum"),
])
def test_wrong_kernels_fail(bug, causal, pattern):
    with pytest.raises(check.CheckFailure, match=pattern):
        ca.check_attention(functools.partial(buggy, bug=bug), "buggy", causal=causal)


@pytest.mark.skipif(cu.on_gpu(), reason="loads are recorded under the interpreter only")
@pytest.mark.parametrize("bug, causal, words", [
    (NO_Q_MASK, False, ["outside input q", "offs_m[:, None] < n"]),
    (NO_Q_MASK, True, ["outside input q"]),
    (NO_KV_LOAD_MASK, False, ["outside input k", "cols[:, None] < n"]),
])
def test_loads_past_the_inputs_fail_naming_the_input(bug, causal, words):
    """Right numbers (the padded rows are never stored, the padded keys weigh 0), wrong loads: the recorded
    loads that fall in the guard zones past q, k or v tell."""
    with pytest.raises(check.CheckFailure) as e:
        ca.check_attention(functools.partial(buggy, bug=bug), "buggy", causal=causal)
    for w in words:
        assert w in str(e.value), str(e.value)


def _eager(q, k, v, causal=False):
    """The tests' own eager attention (not causal): the course's attention_ref is the answer key."""
    p = torch.softmax(q.double() @ k.double().transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
    return (p @ v.double()).to(q.dtype)


def test_out_of_bounds_write_is_caught():
    def writes_past_end(q, k, v, causal=False, out=None):
        o = _eager(q, k, v, causal=causal)
        out.copy_(o)
        flat = out.view(-1)
        torch.as_strided(flat, (1,), (1,), flat.storage_offset() + flat.numel()).fill_(0.5)
        return out
    with pytest.raises(check.CheckFailure, match="outside its buffer"):
        ca.check_attention(writes_past_end, "oob")


def test_an_out_buffer_left_unwritten_fails():
    """The result returned in a new tensor, the out= buffer the caller gave left as it was (NaN-poisoned)."""
    def ignores_out(q, k, v, causal=False, out=None):
        return buggy(q, k, v, causal=causal)
    with pytest.raises(check.CheckFailure, match="left the out= buffer"):
        ca.check_attention(ignores_out, "ignores out")


def test_changed_input_and_crash_and_unfinished():
    def mutates(q, k, v, causal=False):
        o = _eager(q, k, v, causal=causal)
        q.zero_()
        return o
    with pytest.raises(check.CheckFailure, match="changed its input q"):
        ca.check_attention(mutates, "mutates")

    def crashes(q, k, v, causal=False):
        raise RuntimeError("boom")
    with pytest.raises(check.CheckFailure, match="RuntimeError: boom"):
        ca.check_attention(crashes, "crashes")

    def unfinished(q, k, v, causal=False):
        raise NotImplementedError("Exercise 7.1")
    with pytest.raises(NotImplementedError):
        ca.check_attention(unfinished, "unfinished")


def test_wrong_shape_fails():
    with pytest.raises(check.CheckFailure, match="shape"):
        ca.check_attention(lambda q, k, v, causal=False: q[..., :8].clone(), "shape")


@triton.jit
def _unfinished_kernel(o_ptr):
    raise NotImplementedError("Exercise 7.9: not written")


@pytest.mark.skipif(cu.on_gpu(), reason="a raise inside a kernel is a compile error on a GPU")
def test_unfinished_kernel_under_interpreter_names_the_exercise():
    def fn(q, k, v, causal=False):
        o = torch.empty_like(q)
        _unfinished_kernel[(1,)](o)
        return o
    with pytest.raises(NotImplementedError, match="^Exercise 7.9: not written$"):
        ca.check_attention(fn, "unfinished kernel")


def test_the_course_answer_is_refused():
    from course_utils.tuned import attention as tuned
    for answer in (A.flash_attention_teaching, A.attention_ref, tuned.flash_attention):
        with pytest.raises(check.CheckFailure, match="course"):
            ca.check_attention(answer)

    def calls_the_reference(q, k, v, causal=False):
        return A.attention_ref(q, k, v, causal=causal)
    with pytest.raises(check.CheckFailure, match="attention_ref"):
        ca.check_attention(calls_the_reference)


# ---- the lecture's online update and causal mask as a student might get them wrong (check_attention's diagnoses;
# exercises 7.1 and 7.2 are now the split-KV combine and the window), plugged into the notebook's kernel (its
# 32 x 16 tiles on the CPU, the causal key loop stopping after the query tile's last row)
@triton.jit
def _exercise_attn(q_ptr, k_ptr, v_ptr, o_ptr, stride_b, stride_h, stride_n, n_heads, n, sm_scale,
                   HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                   UPDATE_BUG: tl.constexpr, MASK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    base = (pid_bh // n_heads).to(tl.int64) * stride_b + (pid_bh % n_heads).to(tl.int64) * stride_h
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + base + offs_m[:, None] * stride_n + offs_d[None, :], mask=offs_m[:, None] < n, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    hi = n
    if CAUSAL:
        hi = tl.minimum(n, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_mask = cols[:, None] < n
        k = tl.load(k_ptr + base + cols[:, None] * stride_n + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + base + cols[:, None] * stride_n + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k)) * sm_scale
        s = tl.where(cols[None, :] < n, s, float("-inf"))
        if CAUSAL:
            s = MASK(s, offs_m, cols)
        m_i, l_i, acc = _update(m_i, l_i, acc, s, v, UPDATE_BUG)
    out = acc / l_i[:, None]
    tl.store(o_ptr + base + offs_m[:, None] * stride_n + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=offs_m[:, None] < n)


(UPD_OK, UPD_P_OLD_MAX, UPD_ALPHA_INVERTED, UPD_M_NOT_RETURNED, UPD_EXP2, UPD_TILE_MAX, UPD_ACC_LAST,
 UPD_L_LAST) = (tl.constexpr(i) for i in range(8))


@triton.jit
def _update(m_i, l_i, acc, s, v, BUG: tl.constexpr):
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if BUG == UPD_TILE_MAX:   # the tile's own max: -inf in a tile that hides every key of a row
        m_new = tl.max(s, axis=1)
    if BUG == UPD_EXP2:   # exp2 without the log2(e) factor
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
    else:
        alpha = tl.exp(m_i - m_new)
        if BUG == UPD_ALPHA_INVERTED:
            alpha = tl.exp(m_new - m_i)
        p = tl.exp(s - m_new[:, None])
        if BUG == UPD_P_OLD_MAX:
            p = tl.exp(s - m_i[:, None])
    l_i = tl.sum(p, axis=1) if BUG == UPD_L_LAST else l_i * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(v.dtype), v) if BUG == UPD_ACC_LAST else acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    if BUG == UPD_M_NOT_RETURNED:
        return m_i, l_i, acc
    return m_new, l_i, acc


@triton.jit
def _mask_right(s, offs_m, cols):
    return tl.where(offs_m[:, None] >= cols[None, :], s, float("-inf"))


@triton.jit
def _mask_to_zero(s, offs_m, cols):   # the hidden scores set to 0, not -inf
    return tl.where(offs_m[:, None] >= cols[None, :], s, 0.0)


@triton.jit
def _mask_times(s, offs_m, cols):   # s * mask: the same zeros
    return s * (offs_m[:, None] >= cols[None, :])


@triton.jit
def _mask_future(s, offs_m, cols):   # the condition of the keys to hide, given to tl.where as the keys to keep
    return tl.where(offs_m[:, None] < cols[None, :], s, float("-inf"))


@triton.jit
def _mask_tile_local(s, offs_m, cols):   # rows and keys numbered within the tile: right in the first tile only
    rows = tl.arange(0, s.shape[0])
    keys = tl.arange(0, s.shape[1])
    return tl.where(rows[:, None] >= keys[None, :], s, float("-inf"))


@triton.jit
def _mask_fill_100(s, offs_m, cols):   # a finite stand-in for -inf: right while every score stays far above it
    return tl.where(offs_m[:, None] >= cols[None, :], s, -100.0)


def _exercise(update=UPD_OK, mask=_mask_right):
    def fn(q, k, v, causal=False, out=None):
        b, h, n, d = q.shape
        out = torch.empty_like(q) if out is None else out
        _exercise_attn[(triton.cdiv(n, 32), b * h)](q, k, v, out, q.stride(0), q.stride(1), q.stride(2), h, n,
                                                    d ** -0.5, HEAD_DIM=d, BLOCK_M=32, BLOCK_N=16, CAUSAL=causal,
                                                    UPDATE_BUG=update, MASK=mask)
        return out
    return fn


@pytest.mark.parametrize("update, mask, causal, words", [
    (UPD_P_OLD_MAX, _mask_right, False, ["NaN", "exp(s - m_old[:, None])"]),
    (UPD_ALPHA_INVERTED, _mask_right, False, ["NaN", "alpha inverted"]),
    (UPD_M_NOT_RETURNED, _mask_right, False, ["running max is not carried", "return m_new"]),
    (UPD_EXP2, _mask_right, False, ["tl.exp2 without the log2(e) factor"]),
    (UPD_TILE_MAX, _mask_right, True, ["NaN", "tile's own, tl.max(s, 1)"]),
    (UPD_ACC_LAST, _mask_right, False, ["accumulator keeps the last key tile only"]),
    (UPD_L_LAST, _mask_right, False, ["row sum l keeps the last key tile only"]),
    (UPD_OK, _mask_to_zero, True, ["hidden scores to 0, not -inf"]),
    (UPD_OK, _mask_times, True, ["hidden scores to 0, not -inf"]),
    (UPD_OK, _mask_future, True, ["keeps the future keys (j > i)"]),
])
def test_exercise_mistakes_are_named(update, mask, causal, words):
    """A student's online_update (7.1) or causal_mask (7.2) in the notebook's kernel: each usual slip named."""
    with pytest.raises(check.CheckFailure) as e:
        ca.check_attention(_exercise(update, mask), "exercise", causal=causal)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_rows_never_stored_are_told_from_nan_rows_of_the_update():
    """A grid of seq // BLOCK_M programs leaves the last rows unwritten (right elsewhere): the grid is named, not
    the online update's tile max (whose NaN rows are right elsewhere too)."""
    def floor_grid(q, k, v, causal=False, out=None):
        b, h, n, d = q.shape
        out = torch.empty_like(q) if out is None else out
        _exercise_attn[(max(n // 32, 1), b * h)](q, k, v, out, q.stride(0), q.stride(1), q.stride(2), h, n,
                                                 d ** -0.5, HEAD_DIM=d, BLOCK_M=32, BLOCK_N=16, CAUSAL=causal,
                                                 UPDATE_BUG=UPD_OK, MASK=_mask_right)
        return out
    with pytest.raises(check.CheckFailure, match="never stored"):
        ca.check_attention(floor_grid, "grid")


@pytest.mark.parametrize("answer, words", [
    (_exercise(mask=_mask_tile_local), ["query rows and of the keys within the tile", "BLOCK_M = 32, BLOCK_N = 16"]),
    (functools.partial(buggy, bug=CAUSAL_LOCAL_KEYS), ["keys (offs_n, not cols) within the tile", "BLOCK_N = 16"]),
])
def test_a_causal_mask_from_offsets_within_the_tile_is_named(answer, words):
    """tl.arange(0, BLOCK) for the rows and keys (7.2's mask), or offs_n for the keys (a kernel of one's own): right
    in the first tile, wrong past it; every case crosses several tiles, and the name gives the tiles it fits."""
    with pytest.raises(check.CheckFailure) as e:
        ca.check_attention(answer, "tile-local mask", causal=True)
    for w in words:
        assert w in str(e.value), str(e.value)


@pytest.mark.parametrize("answer, causal, says", [
    (_exercise(mask=_mask_fill_100), True, "causal mask sets the hidden scores to a finite value"),
    (functools.partial(buggy, bug=FILL_1E4), True, "causal mask sets the hidden scores to a finite value"),
    (functools.partial(buggy, bug=FILL_1E4), False, "keys past seq in the last key tile are set to a finite score"),
])
def test_a_finite_stand_in_for_minus_inf_is_named(answer, causal, says):
    """Masked scores set to -100 (7.2's mask) or -1e4 (a kernel of one's own, its causal and padding mask in one):
    right while the real scores stay far above the fill, so the case that moves every score far below zero (to
    -150 in float32, -1.2e4 in float16) fails them, and the name does not hang on the fill's exact value."""
    with pytest.raises(check.CheckFailure) as e:
        ca.check_attention(answer, "finite fill", causal=causal)
    assert says in str(e.value), str(e.value)


def _tf32(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a GPU's float32 tl.dot reads it: TF32, the low 13 mantissa bits dropped (float64 out)."""
    return (t.float().view(torch.int32) & ~0x1FFF).view(torch.float32).double()


def _l_last_on_tensor_cores(q, k, v, block_n: int = 16) -> torch.Tensor:
    """The exercise's kernel with "l keeps the last key tile only", its dot products in TF32 as on a GPU."""
    q, k, v = q.double(), k.double(), v.double()
    m = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float64)
    acc = torch.zeros_like(q)
    for start in range(0, q.shape[-2], block_n):
        s = (_tf32(q) @ _tf32(k[..., start:start + block_n, :]).transpose(-1, -2)).float().double() / 8
        m_new = torch.maximum(m, s.amax(-1))
        p = torch.exp(s - m_new[..., None])
        l_last = p.sum(-1)
        acc = acc * torch.exp(m - m_new)[..., None] + (_tf32(p) @ _tf32(v[..., start:start + block_n, :])).float()
        m = m_new
    return (acc / l_last[..., None]).float()


def test_a_fault_that_amplifies_tf32_rounding_is_named_with_the_gpus_near_share():
    """On an H200 the exercise's l-last fault went unnamed: TF32 scores put a few % of its output outside the
    float32 tolerance of its float64 model. With the near share a float32 output gets on a GPU it is named."""
    from course_utils.faults import attention as fa
    q, k, v = (torch.randn(1, 2, 1000, 64) for _ in range(3))
    got = _l_last_on_tensor_cores(q, k, v)
    hint = fa._diagnose(got, q, k, v, False, 5e-3, 5e-3, near_share=fa.TF32_NEAR_SHARE)
    assert "row sum l keeps the last key tile only" in hint, hint
