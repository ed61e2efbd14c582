"""Checks for exercise 7.2: sliding-window (local) causal attention.

:func:`check_window_attention` judges ``fn(q, k, v, window[, out=...])`` for (batch, heads, seq, head_dim)
tensors, q, k, v of one shape: query i sees the ``window`` keys j with i - window < j <= i (itself and the
window - 1 before it; the course's causal alignment with n_q == n_kv). It compares with
:func:`course_utils.kernels.attention.local_attention_ref` in float64 on fresh inputs: sequence lengths that are
not multiples of any tile, windows of 1 key, smaller than a tile, of one tile, of several, of the whole sequence
and past it; then one case with every score moved far down (a mask that hides keys with a finite score passes
elsewhere); outputs NaN-poisoned inside guard zones, inputs inside guard zones.

Under the interpreter every load is recorded, in order: each program loads its query tile, then its key tiles,
so the records say which key tiles each query tile loaded. A key tile wholly left of the window of the tile's
first query (``lo`` left at 0), wholly right of its last query (``hi``), or starting off a ``BLOCK_N`` boundary
(``lo`` not rounded down) fails, though the numbers are right, naming the slip of ``lo`` (LO_SLIPS) that gives
every program's first tile when one does; a load before k (``lo`` below 0) fails too. When the numbers are wrong,
the usual faults of the mask, of ``lo`` and of ``hi`` are recomputed in float64 at the tiles the loads show (every
usual tile on a GPU) and the one that fits is named.
"""

from __future__ import annotations

import inspect

import numpy as np
import torch

from .. import check, env
from ..kernels.attention import local_attention_ref
from .attention import ATTN_TOLERANCES, SCORE_SHIFT, SHIFTED_DOWN, _inputs, _refuse_course
from .loads import in_guards, span, stub_message

_KEEP = "keep = (cols[None, :] <= offs_m[:, None]) & (cols[None, :] > offs_m[:, None] - window)"
_LO = "lo = (tl.maximum(pid_m * BLOCK_M - window + 1, 0) // BLOCK_N) * BLOCK_N"
_HI = "hi = tl.minimum((pid_m + 1) * BLOCK_M, n)"
# the shifted case comes after the others of its dtype, which passed: only the fill of the hidden keys is left
_SHIFT_HINT = ("the other cases pass but this one, every score moved far down (the softmax must not change), does "
               "not: the mask hides keys with a finite score, which here lies above the real ones and takes the "
               f"weight. Hide them with float('-inf'): {_KEEP}, then tl.where(keep, s, float('-inf'))")


def cases():
    """(batch, heads, seq, head_dim, window) cases. The interpreter's exercise tiles are 32 x 16 and a GPU's 64 or
    128 wide: each list has windows below, at and above its tiles, 1, the sequence itself and past it."""
    if env.on_gpu():
        return [(2, 3, 1000, 64, 1), (2, 2, 1031, 64, 37), (1, 3, 777, 64, 64), (1, 2, 1000, 128, 128),
                (2, 2, 523, 64, 300), (1, 2, 301, 64, 301), (1, 2, 203, 64, 5000), (1, 2, 1, 64, 4)]
    return [(1, 2, 70, 16, 1), (1, 2, 70, 16, 5), (1, 1, 45, 16, 16), (1, 2, 77, 32, 32), (1, 1, 77, 16, 40),
            (1, 1, 37, 16, 37), (1, 1, 23, 16, 100), (1, 2, 1, 16, 3)]


def shifted_case():
    """The case whose scores all lie near SCORE_SHIFT (chapter 7's checker's SHIFTED_DOWN): a mask that hides keys
    with a finite score (-100, -1e4) instead of -inf passes wherever the real scores lie far above that fill; here
    they lie below it. Its window is below a tile, so the tiles hold keys their queries hide."""
    return (1, 2, 203, 64, 5) if env.on_gpu() else (1, 2, 45, 16, 5)


def _plan(dtype) -> list:
    """((batch, heads, seq, head_dim, window), score shift) for ``dtype``: the cases, then the shifted one, but for
    float32 on a GPU, whose tl.dot runs in tf32 and loses too many digits of large scores (chapter 7's checker
    skips it too)."""
    plan = [(c, 0.0) for c in cases()]
    return plan if dtype == torch.float32 and env.on_gpu() else plan + [(shifted_case(), SCORE_SHIFT[dtype])]


# ---- the faults, as the keys a query sees: a mask(i, j, w), and the loop's lo(first, last_plus_1, w, bn, n) and
# hi(first, last_plus_1, w, bn, n, lo) for the query tile [first, last_plus_1), key tiles of BLOCK_N = bn from lo;
# a fifth item, True, when the mask scores the keys it hides 0 instead of -inf
def _mask(i, j, w):
    return (j <= i) & (j > i - w)


def _lo(f, e, w, bn, n):
    return torch.div(torch.clamp(f - w + 1, min=0), bn, rounding_mode="floor") * bn


def _hi(f, e, w, bn, n, lo):
    return torch.clamp(e, max=n)


FAULTS = [
    (f"the window is one key too wide (i - window <= j): a window of `window` keys is i - window + 1 .. i, so the "
     f"test is cols > offs_m - window, {_KEEP}", lambda i, j, w: (j <= i) & (j >= i - w), _lo, _hi),
    (f"the window opens on the wrong side: the mask keeps the keys i .. i + window - 1, after the query; a query "
     f"sees itself and the window - 1 keys before it, {_KEEP}", lambda i, j, w: (j >= i) & (j < i + w), _lo, _hi),
    (f"the mask keeps the keys outside the window and hides those in it: tl.where(cond, s, float('-inf')) keeps s "
     f"where cond is True, so cond says which keys a query sees, {_KEEP}", lambda i, j, w: ~_mask(i, j, w), _lo, _hi),
    (f"the mask has no right edge (j <= i): inside the diagonal tile a query sees keys after it, {_KEEP}",
     lambda i, j, w: j > i - w, _lo, _hi),
    ("the window is ignored: this is causal attention (query i sees every key j <= i), right only when window >= "
     f"seq. Hide the keys j <= i - window too, {_KEEP}, and start the loop at the window's first tile, {_LO}",
     lambda i, j, w: j <= i, lambda f, e, w, bn, n: torch.zeros_like(f), _hi),
    (f"lo is rounded up (tl.cdiv): the tile holding key first - window + 1 is skipped, so the first queries of the "
     f"tile miss the oldest keys of their window. Round down, {_LO}", _mask,
     lambda f, e, w, bn, n: -torch.div(-torch.clamp(f - w + 1, min=0), bn, rounding_mode="floor") * bn, _hi),
    (f"lo is computed from the tile's last query (pid_m + 1) * BLOCK_M - 1, whose window starts latest: the tile's "
     f"earlier queries miss their oldest keys. The first query's window starts first, {_LO}", _mask,
     lambda f, e, w, bn, n: torch.div(torch.clamp(e - w, min=0), bn, rounding_mode="floor") * bn, _hi),
    (f"hi stops before the query tile (pid_m * BLOCK_M): the keys on the diagonal, each query's own among them, "
     f"are never loaded, and a query whose whole window lies there sees no key at all (its output is 0). {_HI}",
     _mask, _lo, lambda f, e, w, bn, n, lo: torch.clamp(f, max=n)),
    (f"hi is lo + window: the loop stops `window` keys after the first tile's start, before the diagonal of the "
     f"later queries. The last key any query of the tile sees is its last query's own, {_HI}", _mask, _lo,
     lambda f, e, w, bn, n, lo: torch.clamp(lo + w, max=n)),
    (f"the window is one key too narrow (j > i - window + 1): it holds window - 1 keys, and at window 1 a query "
     f"sees no key (its output is 0). The test is cols > offs_m - window, {_KEEP}",
     lambda i, j, w: (j <= i) & (j > i - w + 1), _lo, _hi),
    (f"the window leaves out the query itself (j < i): query i sees key i and the window - 1 keys before it, and "
     f"query 0 sees no key at all (its output is 0), {_KEEP}", lambda i, j, w: (j < i) & (j >= i - w), _lo, _hi),
    (f"the mask hides only the keys after the query (j <= i): the loop starts at a tile boundary, so its first "
     f"tiles hold keys older than the window of most queries, and the mask must hide those too, {_KEEP}",
     lambda i, j, w: j <= i, _lo, _hi),
    (f"the mask scores the keys it hides 0 where they need -inf: exp(0 - m) is not 0, so every key the loop loads "
     f"counts, the padding past seq too. {_KEEP}, then tl.where(keep, s, float('-inf'))", _mask, _lo, _hi, True),
    (f"hi stops one key tile short ((pid_m + 1) * BLOCK_M - BLOCK_N, the last tile's start): range(lo, hi, BLOCK_N) "
     f"never reaches hi itself, so the last tile of the diagonal is never loaded. {_HI}", _mask, _lo,
     lambda f, e, w, bn, n, lo: torch.clamp(e - bn, max=n)),
    (f"hi is pid_m * BLOCK_M + window: the loop stops `window` keys after the tile's first query, before the "
     f"diagonal of its later queries. The last key any query of the tile sees is its last query's own, {_HI}",
     _mask, _lo,
     lambda f, e, w, bn, n, lo: torch.clamp(f + w, max=n)),
]


def _visible(n, w, bm, bn, mask, lo, hi, zero=False) -> tuple:
    """(seen, zeroed), (n, n + bn) bool for tiles bm x bn: the keys each query's program scores and keeps, and those
    it scores 0 (``zero``: the loaded keys the mask hides, the padding of the last tile, past n, too)."""
    i = torch.arange(n)[:, None]
    j = torch.arange(n + bn)[None, :]
    first = torch.div(i, bm, rounding_mode="floor") * bm
    last1 = first + bm
    lo_t = lo(first, last1, w, bn, n)
    hi_t = hi(first, last1, w, bn, n, lo_t)
    steps = torch.clamp(hi_t - lo_t + bn - 1, min=0).div(bn, rounding_mode="floor")
    loaded = (j >= lo_t) & (j < lo_t + steps * bn)
    keep = mask(i, j, w) & loaded
    return keep & (j < n), (loaded & ~keep) if zero else torch.zeros_like(keep)


def _attend(q, k, v, seen, zeroed) -> torch.Tensor:
    """float64 attention of the keys ``seen`` shows, those ``zeroed`` shows scored 0 (past n, with v = 0, as the
    kernel loads them); a row that sees none is 0 (the kernel's guarded l = 0)."""
    k, v = (torch.nn.functional.pad(t.double(), (0, 0, 0, seen.shape[-1] - t.shape[2])) for t in (k, v))
    s = (q.double() @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    s = torch.where(seen, s, torch.where(zeroed, 0.0, float("-inf")))
    return torch.softmax(s, dim=-1).nan_to_num(0.0) @ v


def _fits(got, q, k, v, w, tiles, atol, rtol, candidates=None) -> list:
    """Every (fault, tile) of ``candidates`` (all the faults at all ``tiles``, (BLOCK_M, BLOCK_N) pairs, by
    default) whose output ``got`` is, in FAULTS' order: where two faults give the same numbers at two tiles on
    every case (hi = pid_m * BLOCK_M at 32 x 16, one tile short at 16 x 32), the more usual one is named. Checked
    on the first head first (a fault that misses there is out), then on them all."""
    g = got.detach().to("cpu", torch.float64)
    q, k, v = q.cpu(), k.cpu(), v.cpu()
    n = q.shape[2]
    fits = []
    for fault, tile in candidates or [(f, t) for f in FAULTS for t in tiles]:
        seen = _visible(n, w, *tile, *fault[1:])
        if all(bool(torch.isclose(g[part], _attend(q[part], k[part], v[part], *seen), atol=atol, rtol=rtol,
                                  equal_nan=True).all()) for part in (np.s_[:1, :1], np.s_[:])):
            fits.append((fault, tile))
    return fits


def _narrow(fn, name, dtype, fits, atol, rtol, with_out) -> list:
    """``fits`` cut down, case by case, to the (fault, tile) pairs that fit the kernel's output on the other cases
    too, until one fault is left: without the loads (a GPU) the tiles are unknown, and at another tile another
    fault can give the same numbers on one case (a window of 1 key)."""
    for b, h, n, d, w in cases():
        if len({fault for fault, _ in fits}) < 2:
            break
        q, k, v = _inputs(b, h, n, d, dtype, 1.0, 0.0)
        try:
            got = fn(q, k, v, w, out=torch.empty_like(q)) if with_out else fn(q, k, v, w)
        except Exception:   # the failure named already is the one to show
            break
        fits = _fits(got, q, k, v, w, None, atol, rtol, candidates=fits) or fits
    return fits


def _hint(fn, name, dtype, got, q, k, v, w, programs, atol, rtol, with_out) -> str:
    """The fault named for a wrong output: fitted at the tiles the loads show (the interpreter), else at every
    usual tile, narrowed over more cases while more than one fault fits."""
    shown = sorted({(bm, t[0][2]) for _, _, bm, t in programs if t})
    usual = sorted({(bm, bn) for bm in (16, 32, 64, 128) for bn in (16, 32, 64, 128)} - set(shown))
    fits = (_fits(got, q, k, v, w, shown, atol, rtol) if shown else []) or _fits(got, q, k, v, w, usual, atol, rtol)
    if len({fault for fault, _ in fits}) > 1:
        fits = _narrow(fn, name, dtype, fits, atol, rtol, with_out)
    return fits[0][0][0] if fits else ""


def _program_tiles(loads, q, k, n, d):
    """[(first query, last query, BLOCK_M, [(first key, last key, BLOCK_N)...])...] per program, in the order run (the
    interpreter runs one program after the other; each loads its query tile before its key tiles)."""
    programs = []
    (q0, q1), (k0, k1) = span(q), span(k)
    size = q.element_size()
    for addr, width in zip(loads.addresses, loads.widths):
        if addr.size == 0:
            continue
        a = addr.astype(np.int64)
        for start, end, is_q in ((q0, q1, True), (k0, k1, False)):
            if a.min() >= start and a.max() < end:
                rows = ((a - start) // size // d) % n
                if is_q:
                    programs.append((int(rows.min()), int(rows.max()), max(width // d, 1), []))
                elif programs:
                    programs[-1][3].append((int(rows.min()), int(rows.max()), max(width // d, 1)))
    return programs


# ---- lo's slips that load a tile wholly left of the window, as lo(first query, w, BLOCK_M, BLOCK_N): one is named
# when it gives the first key tile of every program
LO_SLIPS = [
    ("lo = 0, the causal kernel's start (or a clamp with tl.minimum where tl.maximum belongs)", lambda f, w, bm, bn: 0),
    ("lo starts from key first - window, one before the window's oldest key first - window + 1: where that key "
     "starts a tile, the loop starts a tile early", lambda f, w, bm, bn: max(f - w, 0) // bn * bn),
    ("lo is rounded down to a multiple of BLOCK_M, not of BLOCK_N, the key tiles' width",
     lambda f, w, bm, bn: max(f - w + 1, 0) // bm * bm),
]


def _lo_slip(programs, w) -> str:
    """The slip of LO_SLIPS that gives every program's first key tile, else what is wrong in general."""
    for text, lo in LO_SLIPS:
        if all(tiles[0][0] == lo(first, w, bm, tiles[0][2]) for first, _, bm, tiles in programs if tiles):
            return text
    return "lo does not skip the tiles before the window"


def _tile_faults(case, programs, w) -> None:
    """Fail a key tile loaded wholly outside the window of its query tile, or off a BLOCK_N boundary."""
    for first, last, _, tiles in programs:
        for k_first, k_last, bn in tiles:
            where = (f"{case}: the program of queries {first}..{last} loaded the key tile of rows {k_first}..{k_last}"
                     f" (BLOCK_N = {bn})")
            if k_last < first - w + 1:
                raise check.CheckFailure(
                    f"{where}, wholly left of its window (its first query sees keys from {max(first - w + 1, 0)} "
                    f"on): {_lo_slip(programs, w)}. The numbers are right, the loads are not: a window of {w} keys "
                    f"should cost O(window) per query, not O(seq). {_LO}")
            if k_first > last:
                raise check.CheckFailure(
                    f"{where}, wholly right of the diagonal (its last query sees no key after {last}): hi does not "
                    f"stop after the tile's last query. {_HI}")
            if k_first % bn:
                raise check.CheckFailure(
                    f"{where}: that tile does not start on a multiple of BLOCK_N. lo is not rounded down to a tile "
                    f"boundary (with //: / gives a float): the loop's tiles must be the tiles every program shares "
                    f"(the causal kernel's), and its last tile then reaches past hi. {_LO}")


def _call(fn, name, case, args, kwargs):
    """``fn(*args, **kwargs)``: a NotImplementedError passes through (the interpreter wraps one raised in a
    kernel), any other exception fails the case."""
    try:
        return fn(*args, **kwargs)
    except (NotImplementedError, check.CheckFailure):
        raise
    except Exception as e:
        stub = stub_message(e)
        if stub is not None:
            raise NotImplementedError(stub or f"{name}: not done yet ({e})") from None
        raise check.CheckFailure(f"{case}: your function raised {type(e).__name__}: {e}") from e


def _guard_loads(case, loads, qg, kg, vg) -> None:
    """A load in the guard zone before k or v: lo below 0; past q, k or v: a missing load mask."""
    for g, which in ((qg, "q"), (kg, "k"), (vg, "v")):
        n = in_guards(loads, g)
        if not n:
            continue
        addr = loads.flat().astype(np.int64)
        before = int(((addr >= span(g.buffer)[0]) & (addr < span(g.tensor)[0])).sum())
        fix = (f"lo is below 0 (the window of the first queries starts before key 0): clamp it, {_LO}" if before
               else "a padded row or key of the last tile was loaded without its mask")
        raise check.CheckFailure(f"{case}: your kernel loaded {n} element(s) outside input {which}: {fix}. Past "
                                 "the ends of a buffer there may be no memory at all.")


def check_window_attention(fn, name: str = "sliding-window attention", *, dtypes=None) -> None:
    """Raise :class:`check.CheckFailure` unless ``fn(q, k, v, window)`` is sliding-window causal attention that
    loads only the key tiles its windows reach; print the verdict."""
    _refuse_course(name, fn)
    dtypes = tuple(dtypes or env.supported_dtypes())
    try:
        with_out = "out" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        with_out = False
    for dtype in dtypes:
        atol, rtol = ATTN_TOLERANCES[dtype]
        for (b, h, n, d, w), shift in _plan(dtype):
            case = (f"{name} ({str(dtype).removeprefix('torch.')}, batch={b}, heads={h}, seq={n}, head_dim={d}, "
                    f"window={w}{f', {SHIFTED_DOWN} ({shift:g})' if shift else ''})")
            q, k, v = _inputs(b, h, n, d, dtype, 1.0, 0.0, shift)
            qg, kg, vg = (check.guarded_copy(t) for t in (q, k, v))
            out = check.Guarded((b, h, n, d), dtype) if with_out else None
            with check.track_loads() as loads:
                got = _call(fn, name, case, (qg.tensor, kg.tensor, vg.tensor, w),
                            {"out": out.tensor} if with_out else {})
            if with_out:
                got = out.tensor if got is None else got
                out.check(case)
            for g, t, which in ((qg, q, "q"), (kg, k, "k"), (vg, v, "v")):
                g.check(f"{case}, input {which}")
                check.require(torch.equal(g.tensor, t), f"{case}: your function changed its input {which}")
            _guard_loads(case, loads, qg, kg, vg)
            expected = local_attention_ref(q.double(), k.double(), v.double(), w)
            programs = _program_tiles(loads, qg.tensor, kg.tensor, n, d) if loads.active else []
            hint = ""
            if isinstance(got, torch.Tensor) and got.shape == expected.shape and not bool(
                    torch.isclose(got.detach().to("cpu", torch.float64), expected.cpu(), atol=atol, rtol=rtol).all()):
                hint = _SHIFT_HINT if shift else _hint(fn, name, dtype, got, q, k, v, w, programs, atol, rtol,
                                                       with_out)
            check.compare(case, got, expected, dtype=dtype, atol=atol, rtol=rtol, hint=hint)
            _tile_faults(case, programs, w)
    q, k, v = (check.randn((1, 2, 33, 16), dtypes[0]) for _ in range(3))
    kwargs = {"out": torch.empty_like(q)} if with_out else {}
    check.check_kernel_launches(name, fn, q, k, v, 5, expected=1, **kwargs)
    check.verdict(name, "matches float64 sliding-window attention on ragged sequence lengths, windows from 1 key "
                        "to past the sequence, every dtype tried; key tiles outside the windows skipped (loads "
                        "checked under Triton's interpreter)")
