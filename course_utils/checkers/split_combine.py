"""Checks for exercise 7.1: the combine step of split-KV attention (flash-decoding).

The keys of each query row are split into ``S`` chunks of ``chunk = cdiv(seq, S)`` keys; one program per
(query tile, chunk) stores, per row ``r`` and chunk ``c``, the chunk's normalized output ``o_c = acc_c / l_c``, its
max ``m_c`` and its log-sum-exp ``lse_c = m_c + log(l_c)`` (``o_c = 0``, ``m_c = lse_c = -inf`` where the row sees
no key of the chunk). :func:`check_split_combine` judges ``combine(o_part, m_part, lse_part, out)``: o_part is
(S, rows, head_dim), m_part and lse_part (S, rows), all float32, and out (rows, head_dim) in the dtype tried. The
right combine is ``lse = M + log(sum_c exp(lse_c - M))`` with ``M = max_c lse_c``, then
``out = sum_c o_c * exp(lse_c - lse)``.

The partials are computed here in float64 from fresh q, k, v (ragged lengths, S in 1, 2, 3, 4, 5, causal or
not, a chunk with no key at all) and stored in float32; the output is compared with plain attention of q, k, v
in float64. Inputs and output lie inside guard zones, the output NaN-poisoned. One case stores the chunks
last-first: a sum does not care, but a combine whose running max starts at -inf meets an empty chunk first
there. Three cases test the range of exp, each against a reference other than the row's largest lse_c: scores
of large magnitude (exp(lse_c) overflows); scores shifted far below 0 (a max that starts at 0 makes every
weight exp(lse_c - 0) underflow to 0); one key per head that outscores the rest by over 100, in the first
chunk of one head and the last of the other (a max that skips a chunk, or chunk 0's lse_c as the reference,
overflows). One case has nearly equal scores and values of +100 then -100 along the keys: the chunks' outputs cancel,
and a 16-bit accumulator keeps its partial sums' rounding. When the output is wrong, the usual faults are
recomputed in float32 on the same partials and the one that fits is named
(:mod:`course_utils.faults.split_combine`). The combine is one launch of the student's own kernel.
"""

from __future__ import annotations

import math

import torch

from .. import check, env
from ..faults.split_combine import RIGHT, chunk_past_last, diagnose
from ..kernels.attention import attention_ref
from . import answer_keys
from .attention import ATTN_TOLERANCES
from .window_attention import _call

RANDOM = "random scores"
LARGE = "large-magnitude scores"
SHIFTED = "scores shifted by -200"
NEEDLE = "one key per head outscoring the rest by about 150"
CANCEL = "nearly equal scores, values +100 then -100 along the keys"
SHIFT = -200.0    # SHIFTED's offset of every score: lse_c near -200, exp(-200) underflows float32 (exp(-103.3))
NEEDLE_SCORE = 150.0   # NEEDLE's key scores this much: its chunk outweighs the rest by exp(140) or more
DRIFT = 100.0     # CANCEL's values along axis 0: a 16-bit partial sum near 100-200 rounds by 0.03-0.06
# CANCEL's q scale: scores within a few hundredths of each other, so every row has its own chunk outputs and its
# own rounding (with q = 0 every row of a head had the same ones: a 16-bit sum passed 24 of 400 runs on the CPU)
CANCEL_Q = 0.02
VERDICT = ("matches float64 attention from chunk partials: 1 to 5 chunks, causal and not, empty chunks, "
           "large-magnitude scores, scores far below 0, a chunk outweighing the rest past exp's range, chunk outputs "
           "that cancel, chunks in either order, every dtype tried")
#: each case's hint where no named fault fits (LARGE), or in place of one (SHIFTED, NEEDLE, CANCEL: see _hint)
HINTS = {
    LARGE: f"the random cases pass but this one does not: an exp leaves float32's range (past exp(88) it is inf, "
           f"below exp(-103) it is 0). Subtract each row's largest lse_c, over all of its chunks, before exp: not a "
           f"max that starts at 0 instead of -inf, nor one that skips a chunk. {RIGHT}",
    SHIFTED: "every lse_c here is near -200 (softmax ignores a constant added to a row's scores, so the output is "
             "the same): exp(lse_c - x) underflows to 0 unless x is the row's largest lse_c, and 0 / 0 follows. Here "
             "two faults give the same numbers: the max is not subtracted (exp(lse_c) alone underflows here as it "
             "overflows for large scores), or your max starts at 0 (tl.zeros) instead of -inf, and every lse_c lies "
             f"below it. {RIGHT}",
    NEEDLE: "one key scores about 150 above the others, so its chunk's lse_c is over 100 above every other chunk's "
            "(the first chunk's in one head, the last chunk's in the other): exp(lse_c - x) overflows float32 "
            "(exp(88)) unless x is the row's largest lse_c over every chunk. Does your max skip a chunk, or take "
            f"one chunk's lse_c as the reference? {RIGHT}",
    CANCEL: "the chunks' outputs here are about +100 and -100 and cancel: a float32 sum ends near the small output, "
            "but one accumulated in a 16-bit dtype (or of o_c rounded to it) keeps the rounding of its partial "
            "sums, about 0.03 at 100. Accumulate in float32 (tl.zeros(..., dtype=tl.float32)) and cast once, at "
            "the store.",
}


def cases():
    """(batch, heads, seq, head_dim, splits, causal, what, q_scale, last_first). Chunks of cdiv(seq, S) keys are
    not multiples of any tile; seq 1 with S = 2 has a chunk with no key at all, causal or not. The exp-range and
    CANCEL cases come last: a kernel that fails there passed the usual ones."""
    if env.on_gpu():
        return [(2, 3, 1000, 64, 1, False, RANDOM, 1.0, False),
                (2, 2, 1031, 64, 2, True, RANDOM, 1.0, False),
                (1, 3, 777, 128, 3, True, RANDOM, 1.0, True),
                (1, 2, 523, 64, 5, False, RANDOM, 1.0, False),
                (1, 2, 1, 64, 2, True, "one token", 1.0, True),
                (1, 3, 301, 64, 3, False, LARGE, 60.0, False),
                (1, 2, 203, 64, 5, True, LARGE, 60.0, True),
                (1, 3, 500, 64, 3, True, SHIFTED, 1.0, True),
                (1, 2, 1000, 64, 3, False, NEEDLE, 1.0, False),
                (1, 2, 1024, 64, 4, False, CANCEL, CANCEL_Q, False)]
    return [(1, 2, 37, 16, 1, False, RANDOM, 1.0, False),
            (1, 2, 70, 16, 2, True, RANDOM, 1.0, False),
            (2, 1, 45, 32, 3, True, RANDOM, 1.0, True),
            (1, 1, 23, 16, 5, False, RANDOM, 1.0, False),
            (1, 2, 1, 16, 2, True, "one token", 1.0, True),
            (1, 2, 45, 16, 3, False, LARGE, 60.0, False),
            (1, 1, 53, 16, 5, True, LARGE, 60.0, True),
            (1, 2, 40, 16, 3, True, SHIFTED, 1.0, True),
            (1, 2, 45, 16, 3, False, NEEDLE, 1.0, False),
            (1, 2, 64, 16, 4, False, CANCEL, CANCEL_Q, False)]


def partials(q, k, v, splits: int, causal: bool, last_first: bool = False, shift: float = 0.0):
    """float64 (o_part, m_part, lse_part) of (batch, heads, seq, head_dim) q, k, v, as the split kernel stores
    them: (S, rows, head_dim) and (S, rows), rows = batch * heads * seq; chunk c holds keys c * chunk ..
    (c + 1) * chunk - 1 (chunk S - 1 - c with ``last_first``). ``shift`` is added to every score: the attention
    is the same, m_c and lse_c move by it."""
    b, h, n, d = q.shape
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(d) + shift
    if causal:
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    chunk = -(-n // splits)
    o_part, m_part, lse_part = [], [], []
    for c in range(splits):
        sc = s[..., c * chunk:(c + 1) * chunk]
        if sc.shape[-1] == 0:   # a chunk past the last key: every row sees nothing
            sc = torch.full((b, h, n, 1), float("-inf"), dtype=s.dtype, device=s.device)
        m = sc.amax(-1)
        m_safe = torch.where(m == float("-inf"), 0.0, m)   # a row that sees no key: exp(-inf) = 0, l = 0
        p = torch.exp(sc - m_safe[..., None])
        l = p.sum(-1)
        vc = v.double()[..., c * chunk:(c + 1) * chunk, :]
        acc = p @ vc if vc.shape[-2] else torch.zeros_like(q, dtype=torch.float64)
        o = torch.where(l[..., None] > 0, acc / l.clamp_min(1e-300)[..., None], 0.0)
        o_part.append(o.reshape(-1, d))
        m_part.append(m.reshape(-1))
        lse_part.append((m + torch.log(l)).reshape(-1))   # log(0) = -inf: no key, no weight
    order = slice(None, None, -1) if last_first else slice(None)
    return tuple(torch.stack(t[order]) for t in (o_part, m_part, lse_part))


def _refuse_course(name, fn) -> None:
    """The course's attention and softmax kernels, launchers and references are answers, not parts of one."""
    keys = answer_keys.course_answers("course_utils.kernels.attention", "course_utils.kernels.softmax")
    answer_keys.refuse(name, fn, keys)


def _qkv(b, h, n, d, dtype, q_scale, what=RANDOM):
    """q, k, v in ``dtype``. NEEDLE: q reads axis 0 with weight 1 and one key per head holds NEEDLE_SCORE *
    sqrt(d) there (key 0 in even heads, the last key in odd ones); CANCEL: values +DRIFT on axis 0 over the first
    half of the keys, -DRIFT over the second (with q scaled by CANCEL_Q the scores are nearly equal and the halves
    nearly cancel)."""
    gen = check.generator()
    q, k, v = (check.randn((b, h, n, d), torch.float32, gen=gen) for _ in range(3))
    q = q * q_scale
    if what == NEEDLE:
        q[..., 0] = 1.0
        for head in range(h):
            k[:, head, (n - 1) * (head % 2), 0] = NEEDLE_SCORE * math.sqrt(d)
    if what == CANCEL:
        v[..., 0] += torch.where(torch.arange(n, device=v.device) < n // 2, DRIFT, -DRIFT)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _check_loads(case, loads, guarded) -> None:
    """No load outside the partials (interpreter); a loop over one chunk too many is named as such."""
    hint = chunk_past_last(loads, guarded)
    check.require(not hint, f"{case}: your kernel loaded past the end of its inputs.\nHint: {hint}")
    check.check_loads_inside(case, loads, [g.tensor for g in guarded])


def _hint(what, dtype, got, partial, expected, atol, rtol) -> str:
    """The named fault that fits a wrong output, else the case's own hint. The exp-range and CANCEL cases come
    after the usual ones, which a kernel that fails there has passed: their own hint names its fault."""
    if what in (SHIFTED, NEEDLE):
        return HINTS[what]
    if what == CANCEL:   # a float32 output is summed in float32 whatever the kernel's accumulator
        return HINTS[CANCEL] if dtype.itemsize == 2 else ""
    wrong = isinstance(got, torch.Tensor) and got.shape == expected.shape and not bool(
        torch.isclose(got.detach().to("cpu", torch.float64), expected.cpu(), atol=atol, rtol=rtol).all())
    return (diagnose(got, *partial, expected, atol, rtol) if wrong else "") or HINTS.get(what, "")


def _check_case(fn, name, dtype, b, h, n, d, splits, causal, what, q_scale, last_first) -> None:
    atol, rtol = ATTN_TOLERANCES[dtype]
    case = (f"{name} ({str(dtype).removeprefix('torch.')}, batch={b}, heads={h}, seq={n}, head_dim={d}, "
            f"splits={splits} of {-(-n // splits)} keys, causal={causal}, {what}"
            + (", chunks stored last-first)" if last_first else ")"))
    q, k, v = _qkv(b, h, n, d, dtype, q_scale, what)
    shift = SHIFT if what == SHIFTED else 0.0
    partial = tuple(t.float() for t in partials(q, k, v, splits, causal, last_first, shift))
    guarded = [check.guarded_copy(t) for t in partial]
    out = check.Guarded((b * h * n, d), dtype)
    with check.track_loads() as loads:
        got = _call(fn, name, case, tuple(g.tensor for g in guarded) + (out.tensor,), {})
    got = out.tensor if got is None else got
    out.check(case)
    for g, t, which in zip(guarded, partial, ("o_part", "m_part", "lse_part")):
        g.check(f"{case}, input {which}")
        check.require(torch.equal(g.tensor, t), f"{case}: your function changed its input {which}")
    _check_loads(case, loads, guarded)
    expected = attention_ref(q.double(), k.double(), v.double(), causal=causal).reshape(-1, d)
    hint = _hint(what, dtype, got, partial, expected, atol, rtol)
    check.compare(case, got, expected, dtype=dtype, atol=atol, rtol=rtol, hint=hint)


def check_split_combine(fn, name: str = "split-KV combine", *, attention=None, dtypes=None) -> None:
    """Raise :class:`check.CheckFailure` unless ``fn(o_part, m_part, lse_part, out)`` combines the chunks into
    attention's output (and ``attention(q, k, v, causal=..., splits=...)``, when given, is attention); print the
    verdict."""
    _refuse_course(name, fn)
    dtypes = tuple(dtypes or env.supported_dtypes())
    for dtype in dtypes:
        for c in cases():
            _check_case(fn, name, dtype, *c)
    o, m, lse = (t.float() for t in partials(*_qkv(1, 2, 33, 16, dtypes[0], 1.0), 3, True))
    check.check_kernel_launches(name, fn, o, m, lse, torch.empty(66, 16, dtype=dtypes[0], device=o.device),
                                expected=1)
    if attention is not None:   # the split kernel and the combine together: attention again
        for causal, splits in ((False, 3), (True, 2)):
            q, k, v = _qkv(1, 2, 45, 16, dtypes[0], 1.0)
            atol, rtol = ATTN_TOLERANCES[dtypes[0]]
            case = f"{name}, split kernel and combine together (seq=45, splits={splits}, causal={causal})"
            got = _call(attention, name, case, (q, k, v), {"causal": causal, "splits": splits})
            check.compare(case, got, attention_ref(q.double(), k.double(), v.double(), causal=causal),
                          dtype=dtypes[0], atol=atol, rtol=rtol)
    check.verdict(name, VERDICT)
