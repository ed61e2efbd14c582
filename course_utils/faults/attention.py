"""Chapter 7's usual faults, recomputed in float64 and named (:func:`_diagnose`, used by
:mod:`course_utils.checkers.attention`): when an attention output fails its case, the scale, exp2 without
log2(e), the causal mask, hidden or padded keys scored 0, the online update's rescaling, division and running
max are tried at every usual key tile, and the one that fits is named; an output NaN everywhere, or NaN in
rows and right elsewhere, names the exponent's slip behind it.

Not a checker itself: nothing here takes a student's function. ``checkers.attention.check_attention`` first
refuses the course's answers (the teaching and tuned kernels, SDPA, the reference) and counts launches of the
student's own kernel; ``tests/test_attention_checkers.py`` proves both.
"""

from __future__ import annotations

import math

import torch

from .fits import FaultFits


def _attention64(q, k, v, scale: float, keep) -> torch.Tensor:
    """softmax(q k^T * scale) v in float64, where row i sees key j only if ``keep(i, j)`` (a row that sees
    no key is NaN, as 0/0 in a kernel)."""
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    n = q.shape[-2]
    s = q @ k.transpose(-1, -2) * scale
    s = s.masked_fill(~keep(torch.arange(n)[:, None], torch.arange(n)[None, :]), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


ONLINE_FAULTS = {
    "acc": ("the accumulator is not rescaled when the running max grows: acc = acc * alpha[:, None] + "
            "tl.dot(p, v), with alpha = exp(m_old - m_new), as l is"),
    "l": ("the row sum l is not rescaled when the running max grows: l = l * alpha + tl.sum(p, 1), with alpha = "
          "exp(m_old - m_new), as the accumulator is"),
    "norm": ("the accumulator is divided by l inside the key loop: keep acc unnormalized there and divide once, "
             "after the last key tile (out = acc / l[:, None])"),
    "nodiv": "the accumulator is never divided by the row sum: after the key loop, out = acc / l[:, None]",
    "acc_last": ("the accumulator keeps the last key tile only: add the tile's tl.dot(p, v) to the rescaled "
                 "accumulator, acc = acc * alpha[:, None] + tl.dot(p, v)"),
    "l_last": ("the row sum l keeps the last key tile only: add the tile's sum to the rescaled l, l = l * alpha + "
               "tl.sum(p, 1)"),
    "m_kept": ("the running max is not carried to the next key tile: return m_new (the max of m_old and the tile's "
               "scores), not m_old; with m_old = -inf on every tile alpha = exp(m_old - m_new) is 0 and only the "
               "last key tile counts"),
}


#: the faults whose output depends on where a causal row's key loop stops (its last key tile)
LOOP_STOP_FAULTS = ("norm", "acc_last", "l_last", "m_kept")


def _online_start(q, k, v, block_m: int | None):
    """float64 copies of q, k, v on the CPU, n, the row indices, where each row's key loop stops (after its query
    tile's last row with ``block_m``), and the online softmax's starting m, l and accumulator."""
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    n = q.shape[-2]
    rows = torch.arange(n)[:, None]
    stop = (rows // block_m + 1) * block_m if block_m else torch.full_like(rows, n)
    m = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float64)
    return q, k, v, n, rows, stop, m, torch.zeros(q.shape[:-1], dtype=torch.float64), torch.zeros_like(q)


def _online64(q, k, v, scale: float, causal: bool, block_n: int, fault: str, block_m: int | None = None):
    """The online softmax over key tiles of ``block_n`` in float64, with one of :data:`ONLINE_FAULTS`; with
    ``block_m`` (causal), a row's key loop stops after its query tile's last row, as the exercise's does."""
    q, k, v, n, rows, stop, m, l, acc = _online_start(q, k, v, block_m)  # noqa: E741
    for start in range(0, n, block_n):
        cols = torch.arange(start, min(start + block_n, n))[None, :]
        s = q @ k[..., start:start + block_n, :].transpose(-1, -2) * scale
        if causal:
            s = s.masked_fill(cols > rows, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        alpha = torch.exp(m - m_new).nan_to_num(0.0)   # exp(-inf - -inf): a row with no key yet has nothing
        p = torch.exp(s - m_new[..., None]).nan_to_num(0.0)
        pv = p @ v[..., start:start + block_n, :]
        new_l = (l if fault == "l" else 0.0 if fault == "l_last" else l * alpha) + p.sum(-1)
        new_acc = (acc if fault == "acc" else 0.0 if fault == "acc_last" else acc * alpha[..., None]) + pv
        if fault == "norm":
            new_acc = new_acc / new_l[..., None]
        visited = (start < stop)[:, 0]   # the rows whose key loop reaches this tile
        l = torch.where(visited, new_l, l)  # noqa: E741
        acc = torch.where(visited[:, None], new_acc, acc)
        m = m if fault == "m_kept" else torch.where(visited, m_new, m)
    return acc if fault == "nodiv" else acc / l[..., None]


def _masked_to64(q, k, v, scale: float, block_n: int, block_m: int | None, causal: bool = True,
                 fill: float = 0.0):
    """Attention in float64 as a kernel computes it when the keys it should hide score ``fill``, not -inf:
    causal, a mask ``tl.where(keep, s, fill)`` (with fill 0, ``s * keep`` too); not causal, the padded keys past
    seq scored ``fill`` (0: left unmasked, k loaded as 0). Every key tile of ``block_n`` that row i's loop
    visits (all of them, or with ``block_m`` those up to its query tile's last row) adds exp(fill - m) for each
    such key, the padded keys past seq too (their v is 0)."""
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    n = q.shape[-2]
    pad = -(-n // block_n) * block_n
    i = torch.arange(n)[:, None]
    j = torch.arange(pad)[None, :]
    hi = torch.full_like(i, n) if block_m is None else torch.clamp((i // block_m + 1) * block_m, max=n)
    visited = j < -(-hi // block_n) * block_n
    s = torch.full((*q.shape[:-1], pad), fill, dtype=torch.float64)
    s[..., :n] = q @ k.transpose(-1, -2) * scale
    if causal:
        s = torch.where(j <= i, s, torch.full((), fill, dtype=torch.float64))
    s = s.masked_fill(~visited, float("-inf"))
    vp = torch.zeros((*v.shape[:-2], pad, v.shape[-1]), dtype=torch.float64)
    vp[..., :n, :] = v
    return torch.softmax(s, dim=-1) @ vp


PADDED_KEYS = ("the keys past seq in the last key tile are not masked out of the softmax: loaded as 0 (other=0.0), "
               "each scores 0 and adds exp(0 - m) to the row sum. Hide them: s = tl.where(cols[None, :] < n, s, "
               "float('-inf'))")
MASKED_TO_ZERO = ("the causal mask sets the hidden scores to 0, not -inf: a score of 0 still weighs exp(0 - m) in "
                  "the softmax (s * mask does the same). Hide them with tl.where(offs_m[:, None] >= cols[None, :], "
                  "s, float('-inf'))")
# Finite stand-ins for -inf that students write: harmless while a row's real scores stay far above the fill
# (exp(fill - m) underflows), wrong once they sit near or below it. The checker's "scores with a large negative
# offset" case puts every score far below such a fill, where any fill outweighs the real keys alike and these
# models fit whatever its value; in the large-magnitude case (scores up to about +-200) a few rows reach below
# -100 at random and only the fill's own value fits, so the usual one, -100, is listed.
FINITE_FILLS = (-100.0, -1e4)
MASKED_TO_FINITE = ("the causal mask sets the hidden scores to a finite value (such as -100 or -1e4), not -inf: "
                    "exp(fill - m) vanishes only while the row's real scores stay far above the fill. Shift every "
                    "score down (softmax must not change) and the hidden keys outweigh the real ones. Hide them with "
                    "tl.where(offs_m[:, None] >= cols[None, :], s, float('-inf'))")
PADDED_TO_FINITE = ("the keys past seq in the last key tile are set to a finite score (such as -100 or -1e4), not "
                    "-inf: exp(fill - m) vanishes only while the row's real scores stay far above the fill. Hide them "
                    "with s = tl.where(cols[None, :] < n, s, float('-inf'))")
ALL_NAN = ("every element of your output is NaN. If your kernel stores every row, the online update made it: on "
           "the first key tile the running max m_old is -inf, so alpha = exp(m_old - m_new) is 0 there (right), "
           "while exp(m_new - m_old) (alpha inverted) or exp(s - m_old[:, None]) (p taken against the old max) is "
           "exp(+inf) = inf, and inf * 0 is NaN. Use alpha = tl.exp(m_i - m_new) and p = tl.exp(s - m_new[:, None])")
UNWRITTEN_ROWS = ("the last rows of your output are NaN, and every other element is right: they were never "
                  "stored. The grid must cover every query tile: triton.cdiv(seq, BLOCK_M) programs along axis 0 "
                  "(seq // BLOCK_M leaves out the last, partial tile), and the store's mask is offs_m[:, None] < n")
NAN_ROWS = ("rows of your output are NaN or infinite, and every other element is right: the max subtracted is the "
            "tile's own, tl.max(s, 1), not the running max. In a key tile where every score of a row is masked "
            "(-inf) that gives exp(-inf - (-inf)) = NaN, and where a tile's max lies far below an earlier one, "
            "alpha = exp(m_old - m_new) overflows. Use m_new = tl.maximum(m_i, tl.max(s, 1))")


def _online_masked64(q, k, v, scale: float, keep, block_n: int, block_m: int | None):
    """The right online softmax in float64 under the mask ``keep(i, j)``, NaN where a kernel's is: a row whose
    running max is still -inf after a key tile (every score it has seen masked) gets exp(-inf - (-inf)) = NaN,
    which stays. With ``block_m``, a row's key loop stops after its query tile's last row."""
    q, k, v, n, rows, stop, m, l, acc = _online_start(q, k, v, block_m)  # noqa: E741
    for start in range(0, n, block_n):
        cols = torch.arange(start, min(start + block_n, n))[None, :]
        s = (q @ k[..., start:start + block_n, :].transpose(-1, -2) * scale).masked_fill(~keep(rows, cols),
                                                                                           float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new[..., None])
        visited = (start < stop)[:, 0]
        l = torch.where(visited, l * alpha + p.sum(-1), l)  # noqa: E741
        acc = torch.where(visited[:, None], acc * alpha[..., None] + p @ v[..., start:start + block_n, :], acc)
        m = torch.where(visited, m_new, m)
    return acc / l[..., None]


#: the query and key tile sizes whose tile-local causal masks are tried (as the loop-stop and key tiles elsewhere)
TILE_LOCAL_M = (16, 32, 64, 128, 256)
TILE_LOCAL_N = (16, 32, 64, 128)
TILE_LOCAL = ("the causal mask compares {which} within the tile, not in the sequence (it fits {tiles}): "
              "tl.arange(0, BLOCK) restarts at 0 in every tile, so past the first tile the mask hides keys a query "
              "must see and shows keys it must not. Compare global positions, offs_m = start_m * BLOCK_M + "
              "tl.arange(0, BLOCK_M) for the rows and cols = start_n + tl.arange(0, BLOCK_N) for the keys: {keep}")


def _tile_local_masks(n: int, keep: str):
    """(hint, keep(i, j)) for the causal masks built from positions within a tile: rows and keys both (i % BLOCK_M
    >= j % BLOCK_N), the keys only (offs_n for cols, i >= j % BLOCK_N) or the rows only (i % BLOCK_M >= j), each
    also with the key loop stopping after the query tile's last row. A tile of n rows or more is one tile, whose
    local offsets are the global ones: with such a BLOCK_M the rows-and-keys mask is the keys-only one, and is left
    to it (likewise for BLOCK_N), so that the name says which offsets are local."""
    def stopped(mask, bm):
        return lambda i, j: mask(i, j) & (j < (i // bm + 1) * bm)
    out = []
    for bm in TILE_LOCAL_M:
        for bn in TILE_LOCAL_N:
            if bm < n and bn < n:
                both = TILE_LOCAL.format(which="the offsets of the query rows and of the keys", keep=keep,
                                         tiles=f"BLOCK_M = {bm}, BLOCK_N = {bn}")
                mask = (lambda i, j, bm=bm, bn=bn: i % bm >= j % bn)
                out += [(both, mask), (both, stopped(mask, bm))]
    for bn in TILE_LOCAL_N:
        if bn < n:
            keys = TILE_LOCAL.format(which="the offsets of the keys (offs_n, not cols)", keep=keep,
                                     tiles=f"BLOCK_N = {bn}")
            mask = (lambda i, j, bn=bn: i >= j % bn)
            out += [(keys, mask)] + [(keys, stopped(mask, bm)) for bm in TILE_LOCAL_M]
    for bm in TILE_LOCAL_M:
        if bm < n:
            rows = TILE_LOCAL.format(which="the offsets of the query rows (tl.arange(0, BLOCK_M), not offs_m)",
                                     keep=keep, tiles=f"BLOCK_M = {bm}")
            mask = (lambda i, j, bm=bm: i % bm >= j)
            out += [(rows, mask), (rows, stopped(mask, bm))]
    return out


def _every(i, j):
    return (i >= 0) & (j >= 0)


# A float32 tl.dot on a GPU multiplies in TF32 (10 mantissa bits): a fault whose output divides by a small number
# amplifies that rounding. "l keeps the last key tile only" (acc / l of the last 8 keys of 1000) had 2.3-2.7% of its
# elements outside the GPU's float32 tolerance against its own float64 model with q, k, p, v truncated to TF32 on
# the CPU (0.4% rounded to nearest), and an H200 left it unnamed (2026-11-29) where a near fit allows 1%. On a GPU a
# float32 output's near fit may miss at 5% of its elements, still at most a tenth of the right answer's share.
TF32_NEAR_SHARE = 0.05


def _diagnose(got, q, k, v, causal: bool, atol: float, rtol: float, near_share: float | None = None) -> str:
    """The usual fault that explains ``got``, as a hint ('' when none fits). ``near_share``: how many elements a
    near fit may miss (by default :data:`TF32_NEAR_SHARE` for a float32 output on a GPU, else FaultFits')."""
    if near_share is None:
        tf32 = got.dtype == torch.float32 and got.device.type == "cuda"
        near_share = TF32_NEAR_SHARE if tf32 else FaultFits.NEAR_SHARE
    d = q.shape[-1]
    scale = d ** -0.5
    right = (lambda i, j: j <= i) if causal else _every
    faults = [
        ("the scores are not scaled: multiply q k^T by sm_scale = 1/sqrt(head_dim) before the softmax "
         "(a factor on p after the exp cancels in acc / l)", 1.0, right),
        ("the scores are scaled by 1/head_dim: the scale is 1/sqrt(head_dim)", 1.0 / d, right),
        ("the exponentials are tl.exp2 without the log2(e) factor: exp2(x) = exp(x ln 2), a softmax of the scores "
         "times ln 2. Use tl.exp, or multiply the scores by log2(e) = 1.4427 before tl.exp2", scale * math.log(2.0),
         right),
    ]
    keep = "s = tl.where(offs_m[:, None] >= cols[None, :], s, float('-inf'))"
    masks = []
    if causal:
        masks = [
            (f"the causal mask is missing: row i sees the keys j <= i only, {keep}", _every),
            (f"the causal mask drops the diagonal (j < i): a query sees its own key too, {keep}; with j < i row 0 "
             "sees no key at all and its 0/0 is NaN", lambda i, j: j < i),
            (f"the causal mask is reversed (j >= i): row i sees the keys j <= i, the past, {keep}",
             lambda i, j: j >= i),
            (f"the causal mask lets a query see the next key (j <= i + 1): {keep}", lambda i, j: j <= i + 1),
            (f"the causal mask keeps the future keys (j > i) and hides the rest: tl.where(cond, s, float('-inf')) "
             f"keeps s where cond is True, so cond says which keys a query sees, {keep}", lambda i, j: j > i),
        ]
        # a causal key loop that stops after the query tile's last row sees only the keys j < (i // BLOCK_M + 1)
        # * BLOCK_M: a wrong mask then shows inside that bound only
        for block_m in (None, 16, 32, 64, 128, 256):
            for hint, mask in masks:
                seen = mask if block_m is None else (
                    lambda i, j, mask=mask, bm=block_m: mask(i, j) & (j < (i // bm + 1) * bm))
                faults.append((hint, scale, seen))
        faults += [(hint, scale, mask) for hint, mask in _tile_local_masks(q.shape[-2], keep)]
    g = got.detach().to("cpu", torch.float64)
    if bool(torch.isnan(g).all()):
        return ALL_NAN
    if g.dim() == 4 and g.shape[0] * g.shape[1] > 1:
        # every candidate below is recomputed in float64 on the CPU: judge them on the (batch, head) that differs
        # most, which tells the faults apart as well as all of them do, for a fraction of the work
        off = ~torch.isclose(g, _attention64(q, k, v, scale, right), atol=atol, rtol=rtol)
        b, h = divmod(int(off.sum((-1, -2)).flatten().argmax()), g.shape[1])
        g, q, k, v = (t[b:b + 1, h:h + 1] for t in (g, q, k, v))
    # NaN where a key tile left a row without any key (a kernel's exp(-inf - -inf)) does not hide the fault:
    # a candidate fits where the output is finite, if that is at least a quarter of it
    finite = torch.isfinite(g)
    if float(finite.double().mean()) < 0.25:
        # NaN in most rows: a mask that hides every key of a row's first key tiles (exp(-inf - (-inf)) there)
        # names itself only by a model that makes the same NaN: its NaN where yours is, its numbers elsewhere
        n = q.shape[-2]
        i = torch.arange(n)[:, None]
        for hint, mask in masks if causal else ():
            for block_n in (16, 32, 64, 128):
                for block_m in (None, 16, 32, 64, 128, 256):
                    # the model's NaN rows first (cheap): those that see no key in the first key tile
                    j = torch.arange(min(block_n, n))[None, :]
                    stop = n if block_m is None else torch.clamp((i // block_m + 1) * block_m, max=n)
                    nan_rows = ~(mask(i, j) & (j < stop)).any(1)
                    if not torch.equal(nan_rows[:, None].expand(n, q.shape[-1]).expand_as(finite), ~finite):
                        continue
                    cand = _online_masked64(q, k, v, scale, mask, block_n, block_m)
                    if torch.equal(torch.isnan(cand), ~finite) and bool(
                            torch.isclose(g[finite], cand[finite], atol=atol, rtol=rtol).all()):
                        return hint
        return ""
    # the first candidate that fits everywhere names the fault; failing that, one that nearly fits (FaultFits)
    expected = _attention64(q, k, v, scale, right)
    fits = FaultFits(g, atol, rtol, where=finite, right=expected, near_share=near_share)
    if not bool(finite.all()) and bool(torch.isfinite(expected).all()) and bool(
            torch.isclose(g[finite], expected[finite], atol=atol, rtol=rtol).all()):
        bad = ~finite.all(-1)   # (batch, heads, seq): the rows with a NaN or an infinity
        first = int(bad.double().argmax(-1).min())
        if bool(bad[..., first:].all()) and not bool(bad[..., :first].any()):
            return UNWRITTEN_ROWS   # the last rows alone: never stored (still the NaN the output was filled with)
        return NAN_ROWS   # right wherever finite: the NaN rows are the fault (every candidate below fits there too)
    for hint, sc, keep_fn in faults:
        if fits.add(hint, _attention64(q, k, v, sc, keep_fn)):
            return hint
    finite = MASKED_TO_FINITE if causal else PADDED_TO_FINITE
    for fill, hint in ((0.0, MASKED_TO_ZERO if causal else PADDED_KEYS), *((f, finite) for f in FINITE_FILLS)):
        for block_n in (16, 32, 64, 128):
            if not causal and not q.shape[-2] % block_n:
                continue   # no padded key: nothing hidden
            for block_m in (None, 16, 32, 64, 128, 256) if causal else (None,):
                if not fits.add(hint, _masked_to64(q, k, v, scale, block_n, block_m, causal, fill)):
                    continue
                # where every real score lies far below -100 (the shifted case) a fill of 0 outweighs them just as
                # -100 does; a kernel that fills with 0 fails the random scores before it gets there, so when -100
                # fits too the fill is a finite one
                if fill == 0.0 and fits.add(finite, _masked_to64(q, k, v, scale, block_n, block_m, causal,
                                                                 FINITE_FILLS[0])):
                    return finite
                return hint
    if fits.best():   # a near fit among these: the online update's candidates below cost far more to compute
        return fits.best()
    if q.shape[-2] > 16:   # the online update's faults show once there are two key tiles, whatever their size
        tiles = (16, 32, 64, 128)
        for fault, hint in ONLINE_FAULTS.items():
            for block_n in tiles:
                if block_n >= q.shape[-2] and fault != "nodiv":
                    break
                for block_m in (None, *(t for t in tiles if causal and fault in LOOP_STOP_FAULTS and t >= block_n)):
                    named = hint if fault == "nodiv" else f"{hint} (it fits key tiles of BLOCK_N = {block_n})"
                    if fits.add(named, _online64(q, k, v, scale, causal, block_n, fault, block_m)):
                        return named
                if fault == "nodiv":
                    break   # the same for every tile size
    return fits.best()
