"""The usual faults of chapter 12's cross-entropy backward kernel (exercise 12.1), recomputed in float64 and
named (used by :mod:`course_utils.checkers.training`; the texts are in :mod:`course_utils.checker_texts`): the
one-hot missing, misplaced or added, p not normalized or not exponentiated, exp2, another row's lse or target,
the lse recomputed, the scale's factors missing or applied twice, softmax as exp(x) / exp(lse) (inf / inf).

Not a checker itself: nothing here takes a student's kernel; the checker refuses the course's answers, runs the
kernel and hands a wrong output here.
"""

from __future__ import annotations

import torch

from .. import check
from ..checker_texts.cross_entropy_backward import FAULTS, HINT


def _candidates(logits, targets, lse, block, own_lse=None, scale=None):
    """(fault, what a kernel with that fault computes divided by dloss * inv_n_rows), float64; ``own_lse``:
    the rows' logsumexp, when the ``lse`` passed is another; ``scale``: dloss * inv_n_rows."""
    x = logits.double().cpu()
    lse64 = lse.double().cpu()[:, None]
    t = targets.cpu()[:, None]
    cols = torch.arange(x.shape[1])[None, :]
    p = torch.exp(x - lse64)
    onehot = (cols == t).double()
    first_tile_onehot = ((cols % block) == t).double()            # compares target with offsets, not start + offsets
    p_max = torch.exp(x - x.amax(-1, keepdim=True))
    naive = torch.exp(x.float()).sum(-1, keepdim=True).log().double()   # float32: inf once an exp overflows
    cands = {
        "right": p - onehot,
        "no one-hot": p,
        "target column found only in the first tile": p - first_tile_onehot,
        "the one-hot at target - 1": p - (cols == t - 1).double(),
        "the one-hot at target + 1": p - (cols == t + 1).double(),
        "not normalized by lse": p_max - onehot,
        "one-hot added instead of subtracted": p + onehot,
        "lse recomputed without the max": torch.exp(x - naive) - onehot,
        "log-softmax, not softmax": (x - lse64) - onehot,
        "exp2 without the factor log2(e)": torch.exp2(x - lse64) - onehot,
        # lse_ptr without + pid. In float32, as the kernel computes it: another row's lse can sit hundreds below
        # this row's outliers, where exp overflows to inf (float64 would not) and float32's x - lse rounds by more
        # than the tolerance's 1e-5 relative error
        "the first row's lse in every row": torch.exp(x.float() - lse.float().cpu()[:1, None]).double() - onehot,
        "the first row's target in every row": p - (cols == t[:1]).double(),     # targets_ptr without + pid
        "the target compared with a flat index":                                  # pid * n_cols + cols == target
            p - (cols + torch.arange(x.shape[0])[:, None] * x.shape[1] == t).double(),
        # float32, as the kernel computes it: inf / inf = NaN where both overflow, matched NaN for NaN
        "softmax as exp(x) / exp(lse)": (torch.exp(x.float()) / torch.exp(lse.float().cpu()[:, None])).double()
            - onehot,
    }
    if scale is not None:
        cands["one-hot subtracted after the scaling"] = p - onehot / scale
    if own_lse is not None:
        cands["the given lse ignored"] = torch.exp(x - own_lse.double().cpu()[:, None]) - onehot
    return cands


def _diagnose(case, got, cands, scale, n_cols, block, dtype) -> None:
    g = got.detach().double().cpu() / scale
    atol, rtol = check.tolerance(dtype)
    right = cands["right"]
    if n_cols > block and bool(g[:, block:].isnan().all()) and bool(torch.isclose(
            g[:, :block], right[:, :block], atol=atol, rtol=rtol).all()):
        raise check.CheckFailure(f"{case}: only the first {block} columns of each row were written: loop over "
                                 f"the row in tiles of BLOCK_SIZE={block} (for start in tl.range(0, n_cols, "
                                 "BLOCK_SIZE)).\nHint: " + HINT)
    n_rows = got.shape[0]
    for factor, missing in ((1.0 / scale, "dloss * inv_n_rows"), (float(n_rows), "inv_n_rows (the loss is a mean "
                            "over rows)"), (1.0 / (scale * n_rows), "dloss (read it from dloss_ptr)")):
        if factor != 1.0 and bool(torch.isclose(g, right * factor, atol=atol * abs(factor), rtol=rtol).all()):
            raise check.CheckFailure(f"{case}: your gradient is missing the factor {missing}: dlogits = (softmax - "
                                     "onehot) * dloss * inv_n_rows.")
    for factor, twice in ((1.0 / n_rows, "inv_n_rows twice (the mean over rows taken twice)"),
                          (scale * n_rows, "dloss twice")):
        if factor != 1.0 and bool(torch.isclose(g, right * factor, atol=atol * abs(factor), rtol=rtol).all()):
            raise check.CheckFailure(f"{case}: your gradient has the factor {twice}: dlogits = (softmax - onehot) "
                                     "* dloss * inv_n_rows, each factor once.")
    found = [(fault, why) for fault, why in FAULTS.items()
             if fault in cands and bool(torch.isclose(g, cands[fault], atol=atol, rtol=rtol, equal_nan=True).all())]
    if len(found) == 1:
        raise check.CheckFailure(f"{case}: {found[0][0]}: {found[0][1]}.")
    if found:   # a case too small to tell them apart (one column: the target's neighbours lie outside the row)
        raise check.CheckFailure(f"{case}: one of these faults (this case cannot tell them apart):\n" + "\n".join(
            f"- {fault}: {why}." for fault, why in found))
