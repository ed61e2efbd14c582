"""The usual faults of chapter 13's all-reduce exercises, recomputed in float64 and named (used by
:mod:`course_utils.checkers.allreduce`): a reduce that never ran or left rows unwritten, the norm before the
sum, the residual twice, missing or in x's place, y and s swapped, the weight or the row's RMS wrong (eps outside
the square root or statistics of s taken in x's dtype, named on the checker's quiet and loud rows), only
the own buffer read, a wrong peer offset, a barrier before the writes, an average, the own rows left out,
a sum accumulated in x's dtype (on its exact bits), and ranks that summed in different orders.

Not a checker itself: nothing here takes a student's kernel; the checker refuses the course's answers and
runs the schedule, and hands each output here when it is wrong.
"""

from __future__ import annotations

import torch

from .. import check
from ..checker_texts.allreduce import FAULTS, HINT

EPS = 1e-6


def _fail(case: str, fault: str) -> None:
    raise check.CheckFailure(f"{case}: {fault}: {FAULTS[fault]}.\nHint: {HINT}")


def _rmsnorm(s, w, mean_square=None):
    """RMSNorm(s) * w; ``mean_square`` per row where it is not s's own, exact one."""
    ms = s.pow(2).mean(-1, keepdim=True) if mean_square is None else mean_square
    return s * torch.rsqrt(ms + EPS) * w


def _mean_square_in(s, dtype):
    """mean(s^2) per row as a kernel gets it that squares and averages s in ``dtype`` (float16, bfloat16): each
    square, the row's sum and the division rounded to dtype (inf past its range: float16 ends at 65504). The sum
    itself is exact here; a GPU's tree of float16 adds rounds more, well within the 4x tolerance of a match."""
    low = s.to(dtype)
    return ((low * low).double().sum(-1, keepdim=True).to(dtype) / s.shape[-1]).double()


def _eps_outside_sqrt(s, w):
    return s / (s.pow(2).mean(-1, keepdim=True).sqrt() + EPS) * w


def _diagnose(case, t, got, stale, other_half, rank, kind, dtype, want=None, programs=1, pads_ok=True):
    """Name the fault whose result ``got`` matches, if one does: ``got`` is rank's output (``kind`` "out"),
    its s minus the residual ("s") or its y ("y"), in float64; ``want`` the right one, ``programs`` the grid,
    ``pads_ok`` whether the pads held every flag at its slot once every rank had published."""
    x = [v.double().cpu() for v in t["x"]]
    atol, rtol = check.tolerance(dtype)
    peers = [p for p in range(len(x)) if p != rank]
    nan_rows = got.isnan().all(-1)
    if bool(nan_rows.any()) and not pads_ok:
        _fail(case, "wrong flag index")
    if bool(nan_rows.all()):
        _fail(case, "reduce never ran")
    if want is not None and bool(nan_rows[programs:].all()) and bool(torch.isclose(
            got[:programs], want[:programs], atol=atol, rtol=rtol).all()):
        _fail(case, "rows past the grid never written")
    world = len(x)
    if want is not None and world > programs:   # rows stepped by WORLD: those no program reaches stay unwritten
        reached = torch.zeros(got.shape[0], dtype=torch.bool)
        for pid in range(programs):
            reached[pid::world] = True
        if not bool(reached.all()) and torch.equal(nan_rows, ~reached) and bool(torch.isclose(
                got[reached], want[reached], atol=atol, rtol=rtol).all()):
            _fail(case, "rows WORLD apart")
    total = sum(x)
    candidates = []
    if kind in ("s", "y"):
        r, w = t["r"].double().cpu(), t["w"].double().cpu()
        early = [sum(_rmsnorm(v, w) for v in x), sum(_rmsnorm(v + r, w) for v in x)]
        if kind == "y":
            early += [_rmsnorm(e + r, w) for e in early] + [early[0] + r]
        candidates += [("norm applied before the sum", e) for e in early]
    if kind == "s":
        s_n = (total + r).to(dtype).double()
        candidates += [("residual added twice", total + t["r"].double().cpu()),
                       ("residual not added", total - t["r"].double().cpu()),
                       ("x added instead of the residual", total + x[rank] - r),
                       ("y and s swapped", _rmsnorm(s_n, w) - r)]     # got is s minus the residual
    if kind == "y":
        s_n = (total + r).to(dtype).double()
        block = 1 << max(s_n.shape[-1] - 1, 0).bit_length()
        candidates += [("norm of the sum without the residual", _rmsnorm(total, w)),
                       ("weight missing", _rmsnorm(s_n, 1.0)),
                       ("mean over BLOCK_N", s_n * torch.rsqrt(s_n.pow(2).sum(-1, keepdim=True) / block + EPS) * w),
                       ("eps outside the square root", _eps_outside_sqrt(s_n, w))]
        if dtype != torch.float32:   # in float32 they are the right statistics
            candidates += [("statistics in x's dtype", _rmsnorm(s_n, w, _mean_square_in(s_n, dtype)))]
    if kind in ("out", "s"):
        candidates += [("only the own buffer read", x[rank]), ("only the own buffer read", len(x) * x[rank]),
                       ("wrong peer offset", x[rank] + sum(other_half[p] for p in peers)),
                       ("barrier before the writes", x[rank] + sum(stale[p] for p in peers)),
                       ("averaged instead of summed", total / len(x)),
                       ("own rows left out", total - x[rank])]
    matched = list(dict.fromkeys(fault for fault, want in candidates
                                 if bool(torch.isclose(got, want, atol=atol * 4, rtol=rtol * 4, equal_nan=True).all())))
    if len(matched) == 1:
        _fail(case, matched[0])
    if matched:   # a case too small to tell them apart (one column: every RMSNorm is +-w): name each
        raise check.CheckFailure(f"{case}: one of these faults (this case cannot tell them apart): "
                                 + "; ".join(f"{f}: {FAULTS[f]}" for f in matched) + f".\nHint: {HINT}")
    if kind == "y" and want is not None:   # s was right (y is judged after s): a wrong scale per row
        unscaled = s_n * w
        per_row = (got * unscaled).sum(-1, keepdim=True) / (unscaled * unscaled).sum(-1, keepdim=True).clamp_min(1e-300)
        if bool(torch.isclose(got, unscaled * per_row, atol=atol * 4, rtol=rtol * 4).all()):
            _fail(case, "the row's RMS is wrong")


def _sum_in_16_bits(case, t, fused, dtype) -> None:
    """Fail, naming it, an s or out that holds bit for bit a sum accumulated in float16 or bfloat16 whatever x's
    dtype (each load converted, one rounding per rank's add), then widened: float32's x included."""
    for low_dtype in (torch.float16, torch.bfloat16):
        if low_dtype == dtype:   # that is the sum in x's dtype, named apart
            continue
        low = torch.zeros_like(t["x"][0], dtype=low_dtype)
        for v in t["x"]:
            low = low + v.to(low_dtype)
        want = (low.float() + t["r"].float()).to(dtype) if fused else low.to(dtype)
        right = sum(v.float() for v in t["x"]) + (t["r"].float() if fused else 0.0)
        if torch.equal(want, right.to(dtype)):
            continue
        for rank, g in enumerate(t["s"] if fused else t["out"]):
            if torch.equal(g.tensor, want):
                _fail(f"{case}, rank {rank}'s {'s' if fused else 'out'}", "sum in 16 bits")


def _low_precision_sum(case, t, fused, dtype) -> None:
    """Fail, naming it, an s (fused) or out that holds bit for bit the sum accumulated in x's dtype (one rounding
    per rank's add) where that differs from the float32 sum rounded once: a difference too small for the
    tolerance, found on the exact bits; or a sum accumulated in 16 bits whatever x's dtype."""
    _sum_in_16_bits(case, t, fused, dtype)
    if dtype == torch.float32:
        return
    xs = t["x"]
    low, wide = torch.zeros_like(xs[0]), torch.zeros_like(xs[0], dtype=torch.float32)
    for v in xs:
        low, wide = low + v, wide + v.float()
    if fused:
        r = t["r"]
        low_first = r.clone()
        for v in xs:
            low_first = low_first + v
        lows, rights = [low + r, low_first], [(wide + r.float()).to(dtype), (r.float() + wide).to(dtype)]
        outs = [g.tensor for g in t["s"]]
    else:
        lows, rights, outs = [low], [wide.to(dtype)], [g.tensor for g in t["out"]]
    for rank, got in enumerate(outs):
        if any(torch.equal(got, c) for c in rights):
            continue
        if any(torch.equal(got, c) and not any(torch.equal(c, ok) for ok in rights) for c in lows):
            _fail(f"{case}, rank {rank}'s {'s' if fused else 'out'}", "sum in x's dtype")


def _same_bits(case, t, fused) -> None:
    """Every rank's out (fused: s and y) the same bits as rank 0's."""
    for what in (("s", "y") if fused else ("out",)):
        outs = [g.tensor for g in t[what]]
        for rank, got in enumerate(outs[1:], 1):
            if not torch.equal(got, outs[0]):
                _fail(f"{case}: rank {rank}'s {what} differs from rank 0's in its last bits",
                      "ranks summed in different orders")
