"""Checks for exercise 7.1: the combine step of split-KV attention (flash-decoding).

The keys of each query row are split into ``S`` chunks of ``chunk = cdiv(seq, S)`` keys; one program per
(query tile, chunk) stores, per row ``r`` and chunk ``c``, the chunk's normalized output ``o_c = acc_c / l_c``, its
max ``m_c`` and its log-sum-exp ``lse_c = m_c + log(l_c)`` (``o_c = 0``, ``m_c = lse_c = -inf`` where the row sees
no key of the chunk). :func:`check_split_combine` judges ``combine(o_part, m_part, lse_part, out)``: o_part is
(S, rows, head_dim), m_part and lse_part (S, rows), all float32, and out (rows, head_dim) in the dtype tried. The
right combine is ``lse = M + log(sum_c exp(lse_c - M))`` with ``M = max_c lse_c``, then
``out = sum_c o_c * exp(lse_c - lse)``.

The partials are computed here in float64 from fresh q, k, v (ragged lengths, S in 1, 2, 3, 5, causal or not,
a chunk with no key at all, scores of large magnitude) and stored in float32; the output is compared with plain
attention of q, k, v in float64. Inputs and output lie inside guard zones, the output NaN-poisoned. One case
stores the chunks last-first: a sum does not care, but a combine whose running max starts at -inf meets an
empty chunk first there. When the output is wrong, the usual faults are recomputed in float32 on the same
partials and the one that fits is named. The combine is one launch of the student's own kernel.
"""

from __future__ import annotations

import math

import torch

from .. import check, env
from ..kernels.attention import attention_ref
from . import answer_keys
from .attention import ATTN_TOLERANCES
from .window_attention import _call

_RIGHT = "M = max_c lse_c, lse = M + log(sum_c exp(lse_c - M)), out = sum_c o_c * exp(lse_c - lse)"
LARGE = "large-magnitude scores"


def cases():
    """(batch, heads, seq, head_dim, splits, causal, what, q_scale, last_first). Chunks of cdiv(seq, S) keys are
    not multiples of any tile; seq 1 with S = 2 has a chunk with no key at all, causal or not."""
    if env.on_gpu():
        return [(2, 3, 1000, 64, 1, False, "random scores", 1.0, False),
                (2, 2, 1031, 64, 2, True, "random scores", 1.0, False),
                (1, 3, 777, 128, 3, True, "random scores", 1.0, True),
                (1, 2, 523, 64, 5, False, "random scores", 1.0, False),
                (1, 2, 1, 64, 2, True, "one token", 1.0, True),
                (1, 3, 301, 64, 3, False, LARGE, 60.0, False),
                (1, 2, 203, 64, 5, True, LARGE, 60.0, True)]
    return [(1, 2, 37, 16, 1, False, "random scores", 1.0, False),
            (1, 2, 70, 16, 2, True, "random scores", 1.0, False),
            (2, 1, 45, 32, 3, True, "random scores", 1.0, True),
            (1, 1, 23, 16, 5, False, "random scores", 1.0, False),
            (1, 2, 1, 16, 2, True, "one token", 1.0, True),
            (1, 2, 45, 16, 3, False, LARGE, 60.0, False),
            (1, 1, 53, 16, 5, True, LARGE, 60.0, True)]


def partials(q, k, v, splits: int, causal: bool, last_first: bool = False):
    """float64 (o_part, m_part, lse_part) of (batch, heads, seq, head_dim) q, k, v, as the split kernel stores
    them: (S, rows, head_dim) and (S, rows), rows = batch * heads * seq; chunk c holds keys c * chunk ..
    (c + 1) * chunk - 1 (chunk S - 1 - c with ``last_first``)."""
    b, h, n, d = q.shape
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(d)
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


# ---- the faults, as combines of float32 partials (o (S, R, D), m (S, R), lse (S, R)), run in float32 as a kernel
def _weighted(o, w):
    return (o * w[..., None]).sum(0)


def _no_max(o, m, lse):
    w = torch.exp(lse)                  # overflows to inf once lse > 88
    return _weighted(o, w / w.sum(0))


def _no_max_lse(o, m, lse):
    total = torch.log(torch.exp(lse).sum(0))
    return _weighted(o, torch.exp(lse - total))


def _no_division(o, m, lse):
    return _weighted(o, torch.exp(lse - lse.amax(0)))


def _times_l(o, m, lse):
    w = torch.exp(lse - lse.amax(0))
    return _weighted(o, w) * w.sum(0)[:, None]


def _running_max(o, m, lse):
    """The combine as an online loop whose max starts at -inf, unguarded: exp(-inf - -inf) = NaN."""
    mx = torch.full_like(lse[0], float("-inf"))
    total = torch.zeros_like(lse[0])
    acc = torch.zeros_like(o[0])
    for c in range(lse.shape[0]):
        m_new = torch.maximum(mx, lse[c])
        alpha, w = torch.exp(mx - m_new), torch.exp(lse[c] - m_new)
        total, acc, mx = total * alpha + w, acc * alpha[:, None] + w[:, None] * o[c], m_new
    return acc / total[:, None]


def _mean(o, m, lse):
    return o.mean(0)


def _max_not_lse(o, m, lse):
    w = torch.exp(m - m.amax(0))
    return _weighted(o, w / w.sum(0))


FAULTS = [
    ((_no_max, _no_max_lse),
     f"the max is not subtracted: exp(lse_c) overflows float32 (its largest is about exp(88)) once the scores are "
     f"large, and inf / inf or exp(lse_c - inf) follows. Subtract the largest lse_c first: {_RIGHT}"),
    ((_no_division,),
     f"the weights exp(lse_c - M) are not divided by their total: they are each chunk's share of the row's softmax "
     f"only once divided by sum_c exp(lse_c - M) (the output's rows are then a weighted mean of the o_c). {_RIGHT}"),
    ((_times_l,),
     f"the weighted sum of the o_c is multiplied by the total l = sum_c exp(lse_c - M), not divided by it: o_c is "
     f"already normalized (acc_c / l_c); the weights exp(lse_c - M) / l rebuild each chunk's share. {_RIGHT}"),
    ((_running_max,),
     "a row whose first chunk is empty (lse_c = -inf, no key of that chunk visible) comes out NaN: the running max "
     "starts at -inf, and exp(m - m_new) = exp(-inf - -inf) = exp(NaN). Take the max over every chunk first (a row "
     f"always has a key in some chunk), or guard m_new == -inf as the split kernel does (m_use). {_RIGHT}"),
    ((_mean,),
     "the o_c are averaged with equal weights: a chunk of a few keys, or of small scores, weighs as much as one "
     f"that holds most of the row's softmax. Each weighs exp(lse_c - lse), its share of the total. {_RIGHT}"),
    ((_max_not_lse,),
     f"the weights use m_c, the chunk's max, not lse_c = m_c + log(l_c): two chunks of one max but of 1 and of 100 "
     f"keys near it then weigh the same. The chunk's total is exp(lse_c); m_c alone forgets l_c. {_RIGHT}"),
]


def _diagnose(got, o, m, lse, expected, atol, rtol) -> str:
    g = got.detach().to("cpu", torch.float64)
    o, m, lse = (t.detach().to("cpu", torch.float32) for t in (o, m, lse))
    for forms, what in FAULTS:
        for form in forms:
            with torch.no_grad():
                exp = form(o, m, lse).double()
            if bool(torch.isclose(g, exp, atol=atol, rtol=rtol, equal_nan=True).all()):
                return what
    # An exp without the max goes wrong in many ways once it overflows (inf / inf, inf - inf, 0 * inf, a sum that
    # overflows though no term does): wrong only in rows whose total exp(lse) passes float32's largest, exp(88.7),
    # and right in every other row, is that fault whatever the form.
    risky = (torch.logsumexp(lse.double(), 0) > 87.0)[:, None]
    wrong = ~torch.isclose(g, expected.detach().to("cpu", torch.float64), atol=atol, rtol=rtol)
    if bool(wrong.any()) and not bool((wrong & ~risky).any()):
        return FAULTS[0][1]
    return ""


def _refuse_course(name, fn) -> None:
    """The course's attention and softmax kernels, launchers and references are answers, not parts of one."""
    keys = answer_keys.course_answers("course_utils.kernels.attention", "course_utils.kernels.softmax")
    answer_keys.refuse(name, fn, keys)


def _qkv(b, h, n, d, dtype, q_scale):
    gen = check.generator()
    q, k, v = (check.randn((b, h, n, d), torch.float32, gen=gen) for _ in range(3))
    return (q * q_scale).to(dtype), k.to(dtype), v.to(dtype)


def check_split_combine(fn, name: str = "split-KV combine", *, attention=None, dtypes=None) -> None:
    """Raise :class:`check.CheckFailure` unless ``fn(o_part, m_part, lse_part, out)`` combines the chunks into
    attention's output (and ``attention(q, k, v, causal=..., splits=...)``, when given, is attention); print the
    verdict."""
    _refuse_course(name, fn)
    dtypes = tuple(dtypes or env.supported_dtypes())
    for dtype in dtypes:
        atol, rtol = ATTN_TOLERANCES[dtype]
        for b, h, n, d, splits, causal, what, q_scale, last_first in cases():
            if dtype == torch.float32 and env.on_gpu() and what == LARGE:
                continue   # a float32 reference of large scores: the case is carried by the 16-bit dtypes there
            case = (f"{name} ({str(dtype).removeprefix('torch.')}, batch={b}, heads={h}, seq={n}, head_dim={d}, "
                    f"splits={splits} of {-(-n // splits)} keys, causal={causal}, {what}"
                    + (", chunks stored last-first)" if last_first else ")"))
            q, k, v = _qkv(b, h, n, d, dtype, q_scale)
            o, m, lse = (t.float() for t in partials(q, k, v, splits, causal, last_first))
            guarded = [check.guarded_copy(t) for t in (o, m, lse)]
            out = check.Guarded((b * h * n, d), dtype)
            with check.track_loads() as loads:
                got = _call(fn, name, case, tuple(g.tensor for g in guarded) + (out.tensor,), {})
            got = out.tensor if got is None else got
            out.check(case)
            for g, t, which in zip(guarded, (o, m, lse), ("o_part", "m_part", "lse_part")):
                g.check(f"{case}, input {which}")
                check.require(torch.equal(g.tensor, t), f"{case}: your function changed its input {which}")
            check.check_loads_inside(case, loads, [g.tensor for g in guarded])
            expected = attention_ref(q.double(), k.double(), v.double(), causal=causal).reshape(-1, d)
            hint = (f"the random cases pass but this one does not: subtract the largest lse_c before exp. {_RIGHT}"
                    if what == LARGE else "")
            if isinstance(got, torch.Tensor) and got.shape == expected.shape and not bool(
                    torch.isclose(got.detach().to("cpu", torch.float64), expected.cpu(), atol=atol, rtol=rtol).all()):
                hint = _diagnose(got, o, m, lse, expected, atol, rtol) or hint
            check.compare(case, got, expected, dtype=dtype, atol=atol, rtol=rtol, hint=hint)
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
    check.verdict(name, "matches float64 attention from chunk partials: 1, 2, 3 and 5 chunks, causal and not, "
                        "empty chunks, large-magnitude scores, chunks in either order, every dtype tried")
