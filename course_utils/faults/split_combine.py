"""Exercise 7.1's usual faults, named: the wrong combines of split-KV chunk partials that students write.

Each fault is recomputed in float32 from the partials the check handed the kernel (o (S, R, D), m (S, R),
lse (S, R)); the first whose output matches the student's is named (:func:`diagnose`). A loop over the chunks
that runs once too often reads one whole chunk past the partials' end: :func:`chunk_past_last` says so, where
the loads seen under the interpreter show it, instead of the usual missing-mask message.
"""

from __future__ import annotations

import numpy as np
import torch

from ..checkers.loads import span

RIGHT = "M = max_c lse_c, lse = M + log(sum_c exp(lse_c - M)), out = sum_c o_c * exp(lse_c - lse)"
#: a row's total exp(lse) past this overflows float32 (its largest is about exp(88.7))
OVERFLOW_LSE = 87.0


def _weighted(o, w):
    return (o * w[..., None]).sum(0)


def _share(o, lse, exp=torch.exp):
    """The right combine of the chunks given (``exp`` for exp(lse_c - M)); NaN (0 / 0) where none is."""
    if lse.shape[0] == 0:
        return torch.full(o.shape[1:], float("nan"), dtype=o.dtype)
    w = exp(lse - lse.amax(0))
    return _weighted(o, w / w.sum(0))


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
    return _share(o, m)


def _exp2(o, m, lse):
    return _share(o, lse, torch.exp2)


def _empty_weighs_one(o, m, lse):
    """A guard on lse_c, not on M: an empty chunk's weight exp(-inf - M) = 0 turned into 1."""
    w = torch.where(lse == float("-inf"), 1.0, torch.exp(lse - lse.amax(0)))
    return _weighted(o, w / w.sum(0))


def _empty_lse_zero(o, m, lse):
    """The split kernel's m_use guard copied onto lse_c: an empty chunk's lse_c = -inf turned into 0."""
    w = torch.exp(torch.where(lse == float("-inf"), 0.0, lse) - lse.amax(0))
    return _weighted(o, w / w.sum(0))


def _by_splits(o, m, lse):
    return _weighted(o, torch.exp(lse - lse.amax(0))) / lse.shape[0]


def _skip_last(o, m, lse):
    return _share(o[:-1], lse[:-1])


def _skip_first(o, m, lse):
    return _share(o[1:], lse[1:])


def _chunk0(o, m, lse):
    return o[0]


def _o_stride_rows(o, m, lse):
    """o_c read at c * rows + r * HEAD_DIM + d: the chunk stride of o_part taken as rows, not rows * HEAD_DIM."""
    s, r, d = o.shape
    idx = torch.arange(s)[:, None, None] * r + torch.arange(r)[None, :, None] * d + torch.arange(d)
    return _share(o.reshape(-1)[idx], lse)


NO_MAX = (f"the max is not subtracted (or not the row's largest lse_c): exp(lse_c) overflows float32 (its largest "
          f"is about exp(88)) once the scores are large, and inf / inf or exp(lse_c - inf) follows. Subtract the "
          f"largest lse_c first: {RIGHT}")
FAULTS = (
    ((_no_max, _no_max_lse), NO_MAX),
    ((_no_division,),
     f"the weights exp(lse_c - M) are not divided by their total: they are each chunk's share of the row's softmax "
     f"only once divided by sum_c exp(lse_c - M) (the output's rows are then a weighted mean of the o_c). {RIGHT}"),
    ((_times_l,),
     f"the weighted sum of the o_c is multiplied by the total l = sum_c exp(lse_c - M), not divided by it: o_c is "
     f"already normalized (acc_c / l_c); the weights exp(lse_c - M) / l rebuild each chunk's share. {RIGHT}"),
    ((_running_max,),
     "a row whose first chunk is empty (lse_c = -inf, no key of that chunk visible) comes out NaN: the running max "
     "starts at -inf, and exp(m - m_new) = exp(-inf - -inf) = exp(NaN). Take the max over every chunk first (a row "
     f"always has a key in some chunk), or guard m_new == -inf as the split kernel does (m_use). {RIGHT}"),
    ((_mean,),
     "the o_c are averaged with equal weights: a chunk of a few keys, or of small scores, weighs as much as one "
     f"that holds most of the row's softmax. Each weighs exp(lse_c - lse), its share of the total. {RIGHT}"),
    ((_max_not_lse,),
     f"the weights use m_c, the chunk's max, not lse_c = m_c + log(l_c): two chunks of one max but of 1 and of 100 "
     f"keys near it then weigh the same. The chunk's total is exp(lse_c); m_c alone forgets l_c. {RIGHT}"),
    ((_exp2,),
     "the weights are exp2(lse_c - M): lse_c is a natural log (m_c + log(l_c), the split kernel's tl.log), so its "
     f"weight is tl.exp(lse_c - M), or tl.exp2((lse_c - M) * log2(e)). {RIGHT}"),
    ((_empty_weighs_one, _empty_lse_zero),
     "an empty chunk (lse_c = -inf: the row sees none of its keys) gets a weight: a guard turned its lse_c or its "
     "weight into a finite number. exp(-inf - M) = 0 is already its right weight; only M needs the guard, in a "
     f"padded row past rows, whose every lse_c is -inf. {RIGHT}"),
    ((_by_splits,),
     "the weighted sum is divided by the number of chunks S, not by the weights' total sum_c exp(lse_c - M): a "
     f"chunk's share of the row is exp(lse_c - lse), not 1 / S. {RIGHT}"),
    # before the skips: with S = 2 in a causal case, o_0 is also chunk 0 combined alone
    ((_chunk0,),
     "the output is o_0, the first chunk's, in every row: each load reads chunk 0. Chunk c of row r is at "
     "lse_ptr + c * rows + r, and its o_c at o_ptr + (c * rows + r) * HEAD_DIM + d."),
    ((_skip_last, _skip_first),
     "one chunk is left out: the loop over the chunks runs S - 1 times (range(0, splits - 1), or from 1), and "
     "with S = 1 no chunk at all is combined (0 / 0). Loop over every chunk: for c in range(0, splits)."),
    ((_o_stride_rows,),
     "o_c is read at o_ptr + c * rows + r * HEAD_DIM + d: o_part's chunk stride is rows * HEAD_DIM elements, not "
     "rows (each row holds HEAD_DIM values). Chunk c of row r starts at o_ptr + (c * rows + r) * HEAD_DIM."),
)


def diagnose(got, o, m, lse, expected, atol, rtol) -> str:
    """The message of the fault whose output ``got`` is, or '' when none fits."""
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
    # and right in every other row (there must be some), is that fault whatever the form.
    risky = (torch.logsumexp(lse.double(), 0) > OVERFLOW_LSE)[:, None]
    wrong = ~torch.isclose(g, expected.detach().to("cpu", torch.float64), atol=atol, rtol=rtol)
    if bool(wrong.any()) and bool((~risky).any()) and not bool((wrong & ~risky).any()):
        return NO_MAX
    return ""


def chunk_past_last(loads, guarded) -> str:
    """A hint when the loads past one partial's end cover exactly one more chunk (its rows, and nothing beyond):
    the loop over the chunks ran S + 1 times. A missing row mask reads only a block's padding past the end."""
    addr = np.unique(loads.flat().astype(np.int64))
    for g in guarded:
        end, stop = span(g.tensor)[1], span(g.buffer)[1]
        chunk = g.tensor[0].numel()
        past = addr[(addr >= end) & (addr < stop)]
        if chunk > 1 and past.size == chunk and int(past.max()) < end + chunk * g.tensor.element_size():
            return ("the loads past the end are exactly one chunk more (chunk S, past the last): the loop over the "
                    "chunks runs S + 1 times (range(0, splits + 1), or c <= splits). Chunks are c = 0 .. S - 1.")
    return ""
