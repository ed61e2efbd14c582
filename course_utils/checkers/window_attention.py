"""Checks for exercise 7.2: sliding-window (local) causal attention.

:func:`check_window_attention` judges ``fn(q, k, v, window[, out=...])`` for (batch, heads, seq, head_dim)
tensors, q, k, v of one shape: query i sees the ``window`` keys j with i - window < j <= i (itself and the
window - 1 before it; the course's causal alignment with n_q == n_kv). It compares with
:func:`course_utils.kernels.attention.local_attention_ref` in float64 on fresh inputs: sequence lengths that are
not multiples of any tile, windows of 1 key, smaller than a tile, of one tile, of several, of the whole sequence
and past it; outputs NaN-poisoned inside guard zones, inputs inside guard zones.

Under the interpreter every load is recorded, in order: each program loads its query tile, then its key tiles,
so the records say which key tiles each query tile loaded. A key tile wholly left of the window of the tile's
first query (``lo`` left at 0), wholly right of its last query (``hi``), or starting off a ``BLOCK_N`` boundary
(``lo`` not rounded down) fails, though the numbers are right; a load before k (``lo`` below 0) too. When the
numbers are wrong, the usual faults of the mask, of ``lo`` and of ``hi`` are recomputed in float64 at the tiles
the loads show (every usual tile on a GPU) and the one that fits is named.
"""

from __future__ import annotations

import inspect

import numpy as np
import torch

from .. import check, env
from ..kernels.attention import local_attention_ref
from .attention import ATTN_TOLERANCES, _refuse_course
from .loads import in_guards, span, stub_message

_KEEP = "keep = (cols[None, :] <= offs_m[:, None]) & (cols[None, :] > offs_m[:, None] - window)"
_LO = "lo = (tl.maximum(pid_m * BLOCK_M - window + 1, 0) // BLOCK_N) * BLOCK_N"
_HI = "hi = tl.minimum((pid_m + 1) * BLOCK_M, n)"


def cases():
    """(batch, heads, seq, head_dim, window) cases. The interpreter's exercise tiles are 32 x 16 and a GPU's 64 or
    128 wide: each list has windows below, at and above its tiles, 1, the sequence itself and past it."""
    if env.on_gpu():
        return [(2, 3, 1000, 64, 1), (2, 2, 1031, 64, 37), (1, 3, 777, 64, 64), (1, 2, 1000, 128, 128),
                (2, 2, 523, 64, 300), (1, 2, 301, 64, 301), (1, 2, 203, 64, 5000), (1, 2, 1, 64, 4)]
    return [(1, 2, 70, 16, 1), (1, 2, 70, 16, 5), (1, 1, 45, 16, 16), (1, 2, 77, 32, 32), (1, 1, 77, 16, 40),
            (1, 1, 37, 16, 37), (1, 1, 23, 16, 100), (1, 2, 1, 16, 3)]


# ---- the faults, as the keys a query sees: a mask(i, j, w), and the loop's lo(first, last_plus_1, w, bn, n) and
# hi(first, last_plus_1, w, bn, n, lo) for the query tile [first, last_plus_1), key tiles of BLOCK_N = bn from lo
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
]


def _visible(n, w, bm, bn, mask, lo, hi) -> torch.Tensor:
    """(n, n) bool: the keys each query's program scores and keeps, for tiles bm x bn."""
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    first = torch.div(i, bm, rounding_mode="floor") * bm
    last1 = first + bm
    lo_t = lo(first, last1, w, bn, n)
    hi_t = hi(first, last1, w, bn, n, lo_t)
    steps = torch.clamp(hi_t - lo_t + bn - 1, min=0).div(bn, rounding_mode="floor")
    return mask(i, j, w) & (j >= lo_t) & (j < lo_t + steps * bn)


def _attend(q, k, v, seen) -> torch.Tensor:
    """float64 attention of the keys ``seen`` shows; a row that sees none is 0 (the kernel's guarded l = 0)."""
    s = (q.double() @ k.double().transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(s.masked_fill(~seen, float("-inf")), dim=-1).nan_to_num(0.0) @ v.double()


def _fits(got, q, k, v, w, tiles, atol, rtol, candidates=None) -> list:
    """Every (fault, tile) of ``candidates`` (all the faults at all ``tiles``, (BLOCK_M, BLOCK_N) pairs, by
    default) whose output ``got`` is. Checked on the first head first (a fault that misses there is out), then
    on them all."""
    g = got.detach().to("cpu", torch.float64)
    q, k, v = q.cpu(), k.cpu(), v.cpu()
    n = q.shape[2]
    fits = []
    for fault, tile in candidates or [(f, t) for t in tiles for f in FAULTS]:
        seen = _visible(n, w, *tile, *fault[1:])
        if all(bool(torch.isclose(g[part], _attend(q[part], k[part], v[part], seen), atol=atol, rtol=rtol,
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
        gen = check.generator()
        q, k, v = (check.randn((b, h, n, d), torch.float32, gen=gen).to(dtype) for _ in range(3))
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


def _tile_faults(case, programs, w) -> None:
    """Fail a key tile loaded wholly outside the window of its query tile, or off a BLOCK_N boundary."""
    for first, last, _, tiles in programs:
        for k_first, k_last, bn in tiles:
            where = (f"{case}: the program of queries {first}..{last} loaded the key tile of rows {k_first}..{k_last}"
                     f" (BLOCK_N = {bn})")
            if k_last < first - w + 1:
                raise check.CheckFailure(
                    f"{where}, wholly left of its window (its first query sees keys from {max(first - w + 1, 0)} "
                    f"on): lo does not skip the tiles before the window (lo = 0?). The numbers are right, the loads "
                    f"are not: a window of {w} keys should cost O(window) per query, not O(seq). {_LO}")
            if k_first > last:
                raise check.CheckFailure(
                    f"{where}, wholly right of the diagonal (its last query sees no key after {last}): hi does not "
                    f"stop after the tile's last query. {_HI}")
            if k_first % bn:
                raise check.CheckFailure(
                    f"{where}: that tile does not start on a multiple of BLOCK_N. lo is not rounded down to a tile "
                    f"boundary: the loop's tiles must be the tiles every program shares (the causal kernel's), and "
                    f"its last tile then reaches past hi. {_LO}")


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
        for b, h, n, d, w in cases():
            case = (f"{name} ({str(dtype).removeprefix('torch.')}, batch={b}, heads={h}, seq={n}, head_dim={d}, "
                    f"window={w})")
            gen = check.generator()
            q, k, v = (check.randn((b, h, n, d), torch.float32, gen=gen).to(dtype) for _ in range(3))
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
                hint = _hint(fn, name, dtype, got, q, k, v, w, programs, atol, rtol, with_out)
            check.compare(case, got, expected, dtype=dtype, atol=atol, rtol=rtol, hint=hint)
            _tile_faults(case, programs, w)
    q, k, v = (check.randn((1, 2, 33, 16), dtypes[0]) for _ in range(3))
    kwargs = {"out": torch.empty_like(q)} if with_out else {}
    check.check_kernel_launches(name, fn, q, k, v, 5, expected=1, **kwargs)
    check.verdict(name, "matches float64 sliding-window attention on ragged sequence lengths, windows from 1 key "
                        "to past the sequence, every dtype tried; key tiles outside the windows skipped (loads "
                        "checked under Triton's interpreter)")
