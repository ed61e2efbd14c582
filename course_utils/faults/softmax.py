"""The usual faults of chapters 5 and 6's softmax exercises, recomputed and named (used by
:mod:`course_utils.checkers.softmax`): no max subtracted, masked lanes padded with 0 instead of -inf, rows
found n_cols apart instead of a row stride apart, and for the online softmax a running sum not rescaled,
rescaled by exp(m_new - m) (inverted) or a tile shifted by the old max or by its own, and a loop over the full
tiles that stops one tile short when n_cols is a multiple of BLOCK_SIZE.

The kernels' faults are replayed in float32, the precision the kernel computes in, tile by tile as the kernel
folds them (an overflow to inf and 0 / 0 = NaN come out where the kernel's do). The update rule's (6.1) are
told apart on one probe call whose answers differ for every fault. Not a checker: nothing here takes a
student's function without the checker that refused the course's answers first."""

from __future__ import annotations

import math

import torch

NO_MAX = ("the row's max is not subtracted: exp(x) overflows float32 (inf) once x > 88.7, and inf / inf = NaN, or "
          "underflows to 0 for a row far below 0 (0 / 0 = NaN). Subtract the row's max before tl.exp: "
          "exp(x - m) / sum(exp(x - m)) is the same softmax and never overflows")
PAD_ZERO = ("masked lanes are loaded as 0 (other=0.0): the padding lanes past n_cols then take part in the max "
            "(0 wins on a row below 0) and each adds exp(0 - m) to the sum. Load with other=-float('inf'), "
            "so that a padding lane is exp(-inf) = 0 and never the max")
ROWS_N_COLS = ("row pid is read at x_ptr + pid * n_cols: x's rows are x_row_stride elements apart (here a "
               "slice of a wider tensor), so find the row at x_ptr + pid * x_row_stride")
NO_RESCALE = ("the running sum is not rescaled when the max grows: the terms already in s were computed against "
              "the old max, so rescale s by exp(m - m_new) before adding the tile's exp(x - m_new)")
INVERTED = ("the running sum is rescaled by exp(m_new - m), the inverse of the right factor: when the max grows "
            "the old terms shrink, so rescale s by exp(m - m_new) (at most 1; the inverse overflows)")
OLD_MAX = ("the tile's terms are shifted by the old max, exp(x - m): after the rescale s is a sum against m_new, "
           "so add exp(x - m_new)")
LAST_TILE_STATS = ("the last tile of the row is left out of the running max and sum when n_cols is a multiple of "
                   "BLOCK_SIZE ({cols} = {tiles} x {block} here): a loop over the full tiles that runs while start < "
                   "n_cols - BLOCK_SIZE stops one tile early, and the masked tail after it is empty. Run the full "
                   "tiles while start + BLOCK_SIZE <= n_cols (range(0, n_cols // BLOCK_SIZE * BLOCK_SIZE, "
                   "BLOCK_SIZE)), or mask every tile of one loop (range(0, n_cols, BLOCK_SIZE), mask=cols < n_cols)")
LAST_TILE_UNWRITTEN = ("the last tile of the row is never written when n_cols is a multiple of BLOCK_SIZE ({cols} = "
                       "{tiles} x {block} here; its elements still hold the NaN the output was poisoned with): the "
                       "writing loop over the full tiles runs while start < n_cols - BLOCK_SIZE and stops one tile "
                       "early, and the masked tail after it is empty. Run the full tiles while start + BLOCK_SIZE <= "
                       "n_cols, or mask every tile of one loop (range(0, n_cols, BLOCK_SIZE), mask=cols < n_cols)")
OWN_MAX = ("the tile's terms are shifted by the tile's own max, exp(x - tile.amax()): s is a sum against the "
           "running max, so add exp(x - m_new) with m_new = max(m, tile's max)")


def _fold(x: torch.Tensor, block: int, rescale: str = "right", pad: float = float("-inf"),
          subtract_max: bool = True, guard: bool = True, stats_cols: int | None = None) -> torch.Tensor:
    """exp(x - m) / s in float32, m and s folded over tiles of ``block`` as a kernel does, the last partial
    tile padded with ``pad``; ``rescale``: 'right' (exp(m - m_new)), 'none' or 'inverted' (exp(m_new - m));
    ``guard``: m_new = -inf replaced by 0 where subtracted (without it a tile of -inf gives NaN);
    ``stats_cols``: fold only the tiles before this column (a loop that stops early), write every column."""
    x = x.to("cpu", torch.float32)
    rows, cols = x.shape
    m = torch.full((rows,), float("-inf"))
    s = torch.zeros(rows)
    for start in range(0, cols if stats_cols is None else stats_cols, block):
        t = x[:, start:start + block]
        if t.shape[1] < block:
            t = torch.cat([t, torch.full((rows, block - t.shape[1]), pad)], dim=1)
        if not subtract_max:
            s = s + torch.exp(t).sum(-1)
            continue
        m_new = torch.maximum(m, t.amax(-1))
        safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new) if guard else m_new
        factor = {"right": torch.exp(m - safe), "none": torch.ones_like(s), "inverted": torch.exp(safe - m)}[rescale]
        s = s * factor + torch.exp(t - safe[:, None]).sum(-1)
        m = m_new
    if not subtract_max:
        return torch.exp(x) / s[:, None]
    return torch.exp(x - m[:, None]) / s[:, None]


def row_faults(x: torch.Tensor, block: int, flat_rows: torch.Tensor, online: bool) -> list[tuple[str, torch.Tensor]]:
    """(hint, what the kernel writes) for the usual slips of a softmax kernel over ``x`` (rows, cols) with tiles of
    ``block``; ``flat_rows``: what reading row pid at pid * n_cols gives; ``online``: exercise 6.2's loops."""
    out = [(NO_MAX, _fold(x, block, subtract_max=False)), (PAD_ZERO, _fold(x, block, pad=0.0)),
           (ROWS_N_COLS, _fold(flat_rows, block))]
    if online:
        out += [(NO_RESCALE, _fold(x, block, rescale="none")), (INVERTED, _fold(x, block, rescale="inverted")),
                (NO_RESCALE + " (and while a row has seen only -inf, exp(-inf - -inf) is NaN: keep s = 0 there)",
                 _fold(x, block, rescale="none", guard=False))]
        cols = x.shape[1]
        if cols % block == 0 and cols >= 2 * block:   # full tiles, then an empty tail: a loop bound one tile short
            where = {"cols": cols, "tiles": cols // block, "block": block}
            short = _fold(x, block, stats_cols=cols - block)
            unwritten, both = _fold(x, block), short.clone()
            unwritten[:, cols - block:] = float("nan")
            both[:, cols - block:] = float("nan")
            out += [(LAST_TILE_STATS.format(**where), short), (LAST_TILE_UNWRITTEN.format(**where), unwritten),
                    (LAST_TILE_UNWRITTEN.format(**where) + "; the loop of the running max and sum stops one tile "
                     "early too", both)]
    return out


def name_row_fault(got: torch.Tensor, right: torch.Tensor, candidates, atol: float, rtol: float) -> str:
    """The hint of each candidate within tolerance of ``got`` at every element (NaN where it has NaN) and not
    itself the right answer; several: each, joined ('' when none fits)."""
    g = got.detach().to("cpu", torch.float64)
    r = right.to("cpu", torch.float64)
    fits = []
    for hint, c in candidates:
        c = c.to(torch.float64)
        if torch.isclose(c, r, atol=atol, rtol=rtol, equal_nan=True).all():
            continue   # the slip changes nothing on this input
        if torch.isclose(g, c, atol=atol, rtol=rtol, equal_nan=True).all():
            fits.append(hint)
    if len(fits) > 1:
        return "one of these (this case cannot tell them apart): " + "; or ".join(fits)
    return fits[0] if fits else ""


#: one call of update(m, s, tile) whose s_new differs for every fault: row 0's max grows from 1 to 3, row 1's
#: stays at 3 while its tile holds 1
PROBE_M, PROBE_S, PROBE_TILE = (1.0, 3.0), (1.0, 1.0), ((3.0,), (1.0,))
E = math.e
UPDATE_FAULTS = {NO_RESCALE: (2.0, 1 + E**-2), INVERTED: (E**2 + 1, 1 + E**-2), OLD_MAX: (E**-2 + E**2, 1 + E**-2),
                 OWN_MAX: (E**-2 + 1, 2.0), NO_MAX[:NO_MAX.index(":")] + ": exp(tile - m_new), not exp(tile)":
                 (1 + E**3, 1 + E)}


def name_update_fault(update) -> str:
    """Call ``update`` once on the probe; the fault whose s_new it returns ('' when none, or when it fails)."""
    f64 = torch.float64
    try:
        out = update(torch.tensor(PROBE_M, dtype=f64), torch.tensor(PROBE_S, dtype=f64),
                     torch.tensor(PROBE_TILE, dtype=f64))
        s = out[1].to("cpu", f64)
    except Exception:   # noqa: BLE001 - the fold already failed; a probe that crashes names nothing
        return ""
    for hint, want in UPDATE_FAULTS.items():
        if s.shape == (2,) and torch.allclose(s, torch.tensor(want, dtype=f64), rtol=1e-9, atol=0.0):
            return hint
    return ""
