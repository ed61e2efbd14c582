"""The texts of chapter 12's cross-entropy backward checker (:mod:`course_utils.checkers.training`): what each
named fault means, keyed by the fault's name; the first that matches a kernel's output names it."""

from __future__ import annotations

HINT = ("one program per row: lse and the target come first; then a loop over the row in tiles of BLOCK_SIZE "
        "(cols = start + tl.arange(0, BLOCK_SIZE), mask = cols < n_cols) that loads a tile in float32, computes "
        "tl.exp(x - lse), subtracts 1 where cols == target, multiplies by dloss * inv_n_rows and stores it.")
FLOAT32_EXP_MAX = 88.72  # exp(x) overflows float32 past this
RECOMPUTED = ("your kernel recomputes the row's logsumexp (or its max) instead of using the saved one: the forward "
              "stored lse (lse_ptr) so that the backward reads each row once, p = exp(x - lse) in the same loop that "
              "stores dlogits. A recomputed max and sum are two more passes over every row (50257 logits each in a "
              "GPT-2)")


FAULTS = {  # the first that matches names the fault: a kernel that ignores the given lse is named so first
    "the given lse ignored": RECOMPUTED + ". This case passes an lse that is not the rows' own logsumexp, and "
        "your p is the rows' softmax",
    "no one-hot": "the target's column: dlogits[target] = p[target] - 1; subtract 1 where cols == target",
    "target column found only in the first tile": "the target is compared with the lanes of the tile, not with "
        "the column index: use cols = start + offsets, and cols == target",
    "the one-hot at target - 1": "the 1 is subtracted one column before the target's: targets are 0-based "
        "column indices, so compare cols == target",
    "the one-hot at target + 1": "the 1 is subtracted one column after the target's: targets are 0-based "
        "column indices, so compare cols == target",
    "log-softmax, not softmax": "x - lse is log p, the log-softmax: the gradient is p - onehot with p itself, "
        "tl.exp(x - lse)",
    "exp2 without the factor log2(e)": "tl.exp2(x - lse) is 2**(x - lse), not e**(x - lse): use tl.exp(x - lse), or "
        "tl.exp2((x - lse) * 1.4426950408889634), log2(e) folded in",
    "the first row's lse in every row": "every row used the first row's logsumexp: lse_ptr holds one per row, "
        "tl.load(lse_ptr + pid)",
    "the first row's target in every row": "every row used the first row's target: targets_ptr holds one per row, "
        "tl.load(targets_ptr + pid)",
    "the target compared with a flat index": "the one-hot compares the target with pid * n_cols + cols, an index "
        "into the whole matrix, so only the first row got its 1: a target is a column index of its row, compare "
        "cols == target",
    "softmax as exp(x) / exp(lse)": f"exp(x) and exp(lse) each overflow float32 past {FLOAT32_EXP_MAX} (rows here "
        "reach several hundred), and inf / inf = NaN: take one exponential of the difference, tl.exp(x - lse), "
        "which is at most 1",
    "not normalized by lse": "the softmax needs the row's logsumexp: p = exp(x - lse) with the saved lse, "
        "not exp(x - max of the row)",
    "one-hot added instead of subtracted": "d(loss)/d(logits) = softmax - onehot(target): subtract 1 at the "
        "target's column",
    "one-hot subtracted after the scaling": "the 1 at the target's column was subtracted from p * dloss * "
        "inv_n_rows: the whole difference is scaled, (p - onehot) * dloss * inv_n_rows",
    "lse recomputed without the max": "your kernel recomputes the row's logsumexp without subtracting the row's max "
        f"first: exp(x) overflows float32 past x = {FLOAT32_EXP_MAX} (rows here reach several hundred), so lse = inf "
        "and p = exp(x - lse) = 0. Use the saved lse (lse_ptr), which the forward computed as m + log(sum(exp(x - m))) "
        "with m the row's max",
}

