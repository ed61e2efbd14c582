"""Exercise 7.2's checker (sliding-window attention) passes the exercise's answer and names each usual slip: the
student's window_bounds (lo, hi) and window_mask plugged into the notebook's kernel, 32 x 16 tiles on the CPU."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import course_utils as cu
from course_utils import check
from course_utils.checkers import window_attention as cw
from course_utils.kernels import attention as A


@triton.jit
def _window_attn(q_ptr, k_ptr, v_ptr, o_ptr, stride_b, stride_h, stride_n, n_heads, n, window, sm_scale,
                 HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BOUNDS: tl.constexpr, MASK: tl.constexpr):
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
    lo, hi = BOUNDS(pid_m, n, window, BLOCK_M, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_mask = cols[:, None] < n
        k = tl.load(k_ptr + base + cols[:, None] * stride_n + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + base + cols[:, None] * stride_n + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k)) * sm_scale
        s = tl.where(cols[None, :] < n, s, float("-inf"))
        s = MASK(s, offs_m, cols, window)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(o_ptr + base + offs_m[:, None] * stride_n + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=offs_m[:, None] < n)


# ---- lo and hi: the answer, then each slip
@triton.jit
def _bounds(pid_m, n, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    lo = (tl.maximum(pid_m * BLOCK_M - window + 1, 0) // BLOCK_N) * BLOCK_N
    return lo, tl.minimum((pid_m + 1) * BLOCK_M, n)


@triton.jit
def _bounds_lo_zero(pid_m, n, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):   # the causal kernel's loop
    return 0, tl.minimum((pid_m + 1) * BLOCK_M, n)


@triton.jit
def _bounds_lo_unrounded(pid_m, n, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    return tl.maximum(pid_m * BLOCK_M - window + 1, 0), tl.minimum((pid_m + 1) * BLOCK_M, n)


@triton.jit
def _bounds_lo_rounded_up(pid_m, n, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    lo = tl.cdiv(tl.maximum(pid_m * BLOCK_M - window + 1, 0), BLOCK_N) * BLOCK_N
    return lo, tl.minimum((pid_m + 1) * BLOCK_M, n)


@triton.jit
def _bounds_lo_unclamped(pid_m, n, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    lo = ((pid_m * BLOCK_M - window + 1) // BLOCK_N) * BLOCK_N   # below 0 for the first tiles of a wide window
    return lo, tl.minimum((pid_m + 1) * BLOCK_M, n)


@triton.jit
def _bounds_lo_last_query(pid_m, n, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    lo = (tl.maximum((pid_m + 1) * BLOCK_M - 1 - window + 1, 0) // BLOCK_N) * BLOCK_N
    return lo, tl.minimum((pid_m + 1) * BLOCK_M, n)


@triton.jit
def _bounds_hi_tile_start(pid_m, n, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    lo = (tl.maximum(pid_m * BLOCK_M - window + 1, 0) // BLOCK_N) * BLOCK_N
    return lo, tl.minimum(pid_m * BLOCK_M, n)


@triton.jit
def _bounds_hi_lo_window(pid_m, n, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    lo = (tl.maximum(pid_m * BLOCK_M - window + 1, 0) // BLOCK_N) * BLOCK_N
    return lo, tl.minimum(lo + window, n)


@triton.jit
def _bounds_hi_n(pid_m, n, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    lo = (tl.maximum(pid_m * BLOCK_M - window + 1, 0) // BLOCK_N) * BLOCK_N
    return lo, n


@triton.jit
def _bounds_lo_window(pid_m, n, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):   # window keys before first
    lo = (tl.maximum(pid_m * BLOCK_M - window, 0) // BLOCK_N) * BLOCK_N
    return lo, tl.minimum((pid_m + 1) * BLOCK_M, n)


@triton.jit
def _bounds_lo_minimum(pid_m, n, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    lo = (tl.minimum(pid_m * BLOCK_M - window + 1, 0) // BLOCK_N) * BLOCK_N
    return lo, tl.minimum((pid_m + 1) * BLOCK_M, n)


@triton.jit
def _bounds_lo_block_m(pid_m, n, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    lo = (tl.maximum(pid_m * BLOCK_M - window + 1, 0) // BLOCK_M) * BLOCK_M
    return lo, tl.minimum((pid_m + 1) * BLOCK_M, n)


@triton.jit
def _bounds_lo_true_div(pid_m, n, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    lo = (tl.maximum(pid_m * BLOCK_M - window + 1, 0) / BLOCK_N) * BLOCK_N
    return lo, tl.minimum((pid_m + 1) * BLOCK_M, n)


@triton.jit
def _bounds_hi_tile_short(pid_m, n, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):   # hi: the last tile's start
    lo = (tl.maximum(pid_m * BLOCK_M - window + 1, 0) // BLOCK_N) * BLOCK_N
    return lo, tl.minimum((pid_m + 1) * BLOCK_M - BLOCK_N, n)


@triton.jit
def _bounds_hi_first_window(pid_m, n, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    lo = (tl.maximum(pid_m * BLOCK_M - window + 1, 0) // BLOCK_N) * BLOCK_N
    return lo, tl.minimum(pid_m * BLOCK_M + window, n)


# right, written otherwise: the clamp after the floor division, hi one key short of the tile's end (range still
# visits its last tile)
@triton.jit
def _bounds_clamp_after(pid_m, n, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    lo = tl.maximum((pid_m * BLOCK_M - window + 1) // BLOCK_N, 0) * BLOCK_N
    return lo, tl.minimum(pid_m * BLOCK_M + BLOCK_M - 1, n)


# ---- the mask: the answer, then each slip
@triton.jit
def _mask(s, offs_m, cols, window):
    keep = (cols[None, :] <= offs_m[:, None]) & (cols[None, :] > offs_m[:, None] - window)
    return tl.where(keep, s, float("-inf"))


@triton.jit
def _mask_off_by_one(s, offs_m, cols, window):
    keep = (cols[None, :] <= offs_m[:, None]) & (cols[None, :] >= offs_m[:, None] - window)
    return tl.where(keep, s, float("-inf"))


@triton.jit
def _mask_wrong_side(s, offs_m, cols, window):
    keep = (cols[None, :] >= offs_m[:, None]) & (cols[None, :] < offs_m[:, None] + window)
    return tl.where(keep, s, float("-inf"))


@triton.jit
def _mask_inverted(s, offs_m, cols, window):
    hide = (cols[None, :] <= offs_m[:, None]) & (cols[None, :] > offs_m[:, None] - window)
    return tl.where(hide, float("-inf"), s)


@triton.jit
def _mask_no_right_edge(s, offs_m, cols, window):
    return tl.where(cols[None, :] > offs_m[:, None] - window, s, float("-inf"))


@triton.jit
def _mask_causal(s, offs_m, cols, window):   # the lecture's causal mask, the window ignored
    return tl.where(cols[None, :] <= offs_m[:, None], s, float("-inf"))


@triton.jit
def _mask_too_narrow(s, offs_m, cols, window):
    keep = (cols[None, :] <= offs_m[:, None]) & (cols[None, :] > offs_m[:, None] - window + 1)
    return tl.where(keep, s, float("-inf"))


@triton.jit
def _mask_without_self(s, offs_m, cols, window):   # i - window <= j < i
    keep = (cols[None, :] < offs_m[:, None]) & (cols[None, :] >= offs_m[:, None] - window)
    return tl.where(keep, s, float("-inf"))


@triton.jit
def _mask_zero(s, offs_m, cols, window):
    keep = (cols[None, :] <= offs_m[:, None]) & (cols[None, :] > offs_m[:, None] - window)
    return tl.where(keep, s, 0.0)


@triton.jit
def _mask_fill_100(s, offs_m, cols, window):
    keep = (cols[None, :] <= offs_m[:, None]) & (cols[None, :] > offs_m[:, None] - window)
    return tl.where(keep, s, -100.0)


@triton.jit
def _mask_fill_1e4(s, offs_m, cols, window):
    keep = (cols[None, :] <= offs_m[:, None]) & (cols[None, :] > offs_m[:, None] - window)
    return tl.where(keep, s, -1e4)


@triton.jit
def _mask_twice(s, offs_m, cols, window):   # right: two tl.where, the left edge as a distance
    s = tl.where(cols[None, :] <= offs_m[:, None], s, float("-inf"))
    return tl.where(offs_m[:, None] - cols[None, :] < window, s, float("-inf"))


@triton.jit
def _mask_closed(s, offs_m, cols, window):   # right: i - window + 1 <= j
    keep = (cols[None, :] >= offs_m[:, None] - window + 1) & (cols[None, :] <= offs_m[:, None])
    return tl.where(keep, s, float("-inf"))


def _exercise(bounds=_bounds, mask=_mask):
    def fn(q, k, v, window, out=None):
        b, h, n, d = q.shape
        out = torch.empty_like(q) if out is None else out
        _window_attn[(triton.cdiv(n, 32), b * h)](q, k, v, out, q.stride(0), q.stride(1), q.stride(2), h, n, window,
                                                  d ** -0.5, HEAD_DIM=d, BLOCK_M=32, BLOCK_N=16,
                                                  BOUNDS=bounds, MASK=mask)
        return out
    return fn


def test_the_answer_passes(capsys):
    cw.check_window_attention(_exercise(), "window answer")
    assert "PASS window answer" in capsys.readouterr().out


@pytest.mark.parametrize("bounds, mask", [(_bounds_clamp_after, _mask), (_bounds, _mask_twice),
                                         (_bounds, _mask_closed)], ids=["clamp-after", "where-twice", "closed"])
def test_answers_written_otherwise_pass(bounds, mask, capsys):
    cw.check_window_attention(_exercise(bounds, mask), "window")
    assert "PASS window" in capsys.readouterr().out


def test_the_reference_is_right_on_a_small_case():
    """local_attention_ref against the definition, written out row by row."""
    q, k, v = (torch.randn(1, 1, 9, 4, dtype=torch.float64) for _ in range(3))
    got = A.local_attention_ref(q, k, v, 3)
    for i in range(9):
        keys = list(range(max(0, i - 2), i + 1))
        p = torch.softmax(q[0, 0, i] @ k[0, 0, keys].T / 2.0, dim=-1)
        assert torch.allclose(got[0, 0, i], p @ v[0, 0, keys])


# wrong numbers: id -> (bounds, mask, words the failure must hold)
WRONG_NUMBERS = {
    "off-by-one": (_bounds, _mask_off_by_one, ["one key too wide (i - window <= j)"]),
    "wrong-side": (_bounds, _mask_wrong_side, ["opens on the wrong side"]),
    "inverted": (_bounds, _mask_inverted, ["keeps the keys outside the window"]),
    "no-right-edge": (_bounds, _mask_no_right_edge, ["no right edge"]),
    "causal": (_bounds_lo_zero, _mask_causal, ["the window is ignored", "causal attention"]),
    "lo-rounded-up": (_bounds_lo_rounded_up, _mask, ["lo is rounded up"]),
    "lo-last-query": (_bounds_lo_last_query, _mask, ["lo is computed from the tile's last query"]),
    "hi-tile-start": (_bounds_hi_tile_start, _mask, ["hi stops before the query tile", "sees no key at all"]),
    "hi-lo-window": (_bounds_hi_lo_window, _mask, ["hi is lo + window"]),
    "too-narrow": (_bounds, _mask_too_narrow, ["one key too narrow"]),
    "without-self": (_bounds, _mask_without_self, ["leaves out the query itself"]),
    "causal-mask-window-lo": (_bounds, _mask_causal, ["hides only the keys after the query"]),
    "zero-fill": (_bounds, _mask_zero, ["scores the keys it hides 0"]),
    "hi-tile-short": (_bounds_hi_tile_short, _mask, ["hi stops one key tile short"]),
    "hi-first-window": (_bounds_hi_first_window, _mask, ["hi is pid_m * BLOCK_M + window"]),
}
# those whose numbers another fault gives at another tile on some case: named without the loads too
SAME_NUMBERS_ELSEWHERE = ["lo-rounded-up", "lo-last-query", "hi-tile-start", "hi-lo-window", "off-by-one",
                          "too-narrow", "without-self", "causal-mask-window-lo", "zero-fill", "hi-tile-short",
                          "hi-first-window"]


def _named(fault) -> None:
    bounds, mask, words = WRONG_NUMBERS[fault]
    with pytest.raises(check.CheckFailure) as e:
        cw.check_window_attention(_exercise(bounds, mask), "window")
    for w in words:
        assert w in str(e.value), str(e.value)


@pytest.mark.parametrize("fault", list(WRONG_NUMBERS))
def test_wrong_numbers_are_named(fault):
    _named(fault)


@pytest.mark.parametrize("fault", SAME_NUMBERS_ELSEWHERE)
def test_without_the_loads_the_fault_is_named_over_more_cases(fault, monkeypatch):
    """A GPU's view: no loads recorded, so the tiles are unknown, and on one case another fault at another tile can
    give the same numbers (a GPU named lo-rounded-up as lo-last-query at window 1 before the checker narrowed the
    faults that fit over more cases)."""
    monkeypatch.setattr(cw, "_program_tiles", lambda *a: [])
    _named(fault)


@pytest.mark.skipif(cu.on_gpu(), reason="loads are recorded under the interpreter only")
@pytest.mark.parametrize("bounds, words", [
    (_bounds_lo_zero, ["wholly left of its window", "lo = 0"]),
    (_bounds_hi_n, ["wholly right of the diagonal", "hi does not stop"]),
    (_bounds_lo_unrounded, ["not rounded down to a tile boundary"]),
    (_bounds_lo_unclamped, ["outside input k", "lo is below 0"]),
    (_bounds_lo_window, ["wholly left of its window", "lo starts from key first - window"]),
    (_bounds_lo_minimum, ["wholly left of its window", "lo = 0", "tl.minimum"]),
    (_bounds_lo_block_m, ["wholly left of its window", "rounded down to a multiple of BLOCK_M"]),
    (_bounds_lo_true_div, ["not rounded down to a tile boundary", "/ gives a float"]),
], ids=["lo-zero", "hi-n", "lo-unrounded", "lo-unclamped", "lo-window", "lo-minimum", "lo-block-m", "lo-true-div"])
def test_right_numbers_wrong_tiles_are_named(bounds, words):
    """Right numbers (the mask hides what the loop should have skipped), wrong loads: the key tiles each query
    tile loaded, in the interpreter's records, tell."""
    with pytest.raises(check.CheckFailure) as e:
        cw.check_window_attention(_exercise(bounds, _mask), "window")
    for w in words:
        assert w in str(e.value), str(e.value)


@pytest.mark.parametrize("mask, dtype", [(_mask_fill_100, "float32"), (_mask_fill_1e4, "float16")],
                         ids=["fill-100", "fill-1e4"])
def test_a_finite_fill_is_refused(mask, dtype):
    """Right numbers wherever the real scores lie far above the fill: the case with every score moved down
    (chapter 7's SHIFTED_DOWN) puts them below it, and the hidden keys take the weight."""
    with pytest.raises(check.CheckFailure) as e:
        cw.check_window_attention(_exercise(_bounds, mask), "window")
    if dtype == "float32" and cu.on_gpu():   # float32's plan has no shifted case there (tf32 dots): float16's
        dtype = "float16"
    for w in (f"({dtype}", "scores with a large negative offset", "a finite score"):
        assert w in str(e.value), str(e.value)


@pytest.mark.parametrize("answer", [
    lambda q, k, v, window, out=None: A.flash_attention_teaching(q, k, v, causal=True),
    lambda q, k, v, window, out=None: A.local_attention_ref(q, k, v, window),
    A.local_attention_ref,
], ids=["causal-teaching-kernel", "calls-the-reference", "the-reference"])
def test_the_course_answer_is_refused(answer):
    with pytest.raises(check.CheckFailure, match="course"):
        cw.check_window_attention(answer, "answer key")


def test_the_stub_raises_not_implemented():
    @triton.jit
    def _stub_bounds(pid_m, n, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        raise NotImplementedError("Exercise 7.2: replace this line with your code")

    fn = _exercise(bounds=_stub_bounds)
    with pytest.raises(NotImplementedError, match="Exercise 7.2"):
        cw.check_window_attention(fn, "stub")


def test_a_stub_is_found_in_the_cause_of_a_compile_error():
    """A GPU's compiler fails on the stub's raise line inside the jit function the kernel calls: the error of the
    call names only the call, its cause holds the raise line (Triton 3.6)."""
    from course_utils.checkers.loads import stub_message

    class CompilationError(Exception):
        pass

    try:
        try:
            raise CompilationError('at 2:4:\n    raise NotImplementedError("Exercise 7.2: the key tiles")\n    ^')
        except CompilationError as inner:
            raise CompilationError("at 14:13:\n    lo, hi = BOUNDS(pid_m, n, window, BLOCK_M, BLOCK_N)\n") from inner
    except CompilationError as outer:
        assert stub_message(outer) == "Exercise 7.2: the key tiles"
        assert stub_message(outer.__cause__.__class__("a typo")) is None
