"""Checks for chapter 11's exercise 11.3: a student's whole FlashAttention backward.

:func:`check_flash_backward` calls a student's ``flash_backward(q, k, v, o, lse, do, causal, sm_scale)``
(their 11.1 delta kernel, dK/dV pass and dQ pass) on contiguous inputs: one head, grouped-query 4/1 and
4/2, causal with more keys than queries and more queries than keys, and with an offset n_kv - n_q = 1
modulo the tile (where a causal tile skip off by one drops a tile), a random dO (so D != 0); in float16
2048 keys whose dQ partial sums cancel (a 16-bit dQ accumulator fails it); a wrong answer is compared with
the float64 answer of each usual mistake to name it; three launches. The course's kernels (inside the
student's too), references and torch.autograd are refused as the answer; a load outside the guard zones
around the inputs fails (under the interpreter). :mod:`course_utils.checkers.backward` re-exports it with
chapter 11's other checks.
"""

from __future__ import annotations

import inspect

import torch

from .. import check, env
from .loads import LOADS_SEEN, in_guards


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---- Exercise 11.3: the FlashAttention backward ------------------------------------------------------
# (batch, heads, kv_heads, n_q, n_kv, head_dim, causal, sm_scale): one head first, then grouped-query 4/1
# and 4/2, causal with more keys than queries and with more queries than keys (rows that see no key), and
# a causal offset n_kv - n_q = 1 (mod 16, 32 and on a GPU 64): the last key a query tile sees is then the
# first of its key tile, which a tile skip off by one drops.
ATTN_CASES = env.pick(
    gpu=((1, 1, 1, 61, 61, 32, False, None), (2, 4, 1, 200, 333, 64, False, None),
         (1, 4, 2, 150, 257, 128, True, 0.2), (1, 8, 2, 300, 130, 80, True, None),
         (1, 2, 1, 100, 165, 64, True, None)),
    cpu=((1, 1, 1, 21, 21, 16, False, None), (2, 4, 1, 19, 27, 24, False, None),
         (1, 4, 2, 17, 30, 16, True, 0.3), (1, 2, 1, 30, 13, 16, True, None),
         (1, 2, 1, 24, 57, 16, True, None)))
# (n_q, n_kv, head_dim) of the case whose dQ needs a float32 accumulator: 128 key tiles of 16 (or more)
COMMON_KEY_CASE = (16, 2048, 16)
COMMON_KEY, DRIFT = 8.0, 4.0    # the keys' shared component along one axis; the values' drift along the keys
LOG2E = 1.4426950408889634
PRECISION_LOSS = 1e-2  # float32 errors above tol, below this: TF32 dots (~1e-3 on an H100) or a 16-bit cast


def _masked_p(s, lse, keep, exp=torch.exp):
    """exp(s - lse) where kept, 0 elsewhere (a row with no visible key has lse = -inf: its P is 0)."""
    lse = lse.masked_fill(lse == float("-inf"), float("inf"))
    return torch.where(keep, exp(s - lse[..., None]), torch.zeros((), dtype=s.dtype, device=s.device))


def attention_grads64(q, k, v, do, causal, scale, *, p=None, delta=True, lse_rows=None):
    """float64 (o, lse, dq, dk, dv, dk per q head, dv per q head), from the textbook formulas, causal
    aligned bottom-right; ``p``/``delta``/``lse_rows`` build a wrong answer for a diagnosis."""
    q, k, v, do = (t.double() for t in (q, k, v, do))
    B, H, N, _ = q.shape
    H_kv, N_kv = k.shape[1], k.shape[2]
    g = H // H_kv
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ kk.transpose(-1, -2) * scale
    keep = torch.ones(N, N_kv, dtype=torch.bool, device=q.device)
    if causal:
        keep = keep.tril(N_kv - N)
    lse = torch.logsumexp(s.masked_fill(~keep, float("-inf")), -1)
    o = _masked_p(s, lse, keep) @ vv
    if p is None:
        p = _masked_p(s, lse if lse_rows is None else lse_rows(lse), keep)
    elif callable(p):
        p = p(s, lse, keep)
    ds = p * (do @ vv.transpose(-1, -2) - ((do * o).sum(-1, keepdim=True) if delta else 0.0))
    dk_h, dv_h = scale * ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ do
    dk, dv = (t.view(B, H_kv, g, N_kv, -1).sum(2) for t in (dk_h, dv_h))
    return o, lse, scale * ds @ kk, dk, dv, dk_h, dv_h


def _rel(got, want) -> float:
    want = want.double()
    err = (got.double() - want).abs().max()
    return float(err / want.abs().max().clamp_min(1e-30)) if torch.isfinite(got).all() else float("inf")


def _wrong_p(causal, scale, g, H, N, N_kv) -> dict:
    """{the usual mistake in recomputing P: attention_grads64's keywords that make it} (None: not in this case)."""
    return {
        "a top-left causal mask: the course aligns it bottom-right (key j visible from query i when "
        "j <= i + causal_offset, causal_offset = n_kv - n_q), as FlashAttention does":
            dict(p=lambda s, lse, keep: _masked_p(s, lse, torch.ones_like(keep).tril(0))) if causal else None,
        "no causal mask (both passes mask P: key j visible from query i when j <= i + causal_offset)":
            dict(p=lambda s, lse, keep: _masked_p(s, lse, torch.ones_like(keep))) if causal else None,
        "a causal mask that hides the diagonal: key j is visible from query i when j <= i + causal_offset "
        "(<=, not <)":
            dict(p=lambda s, lse, keep: _masked_p(s, lse, keep & torch.ones_like(keep).tril(N_kv - N - 1)))
            if causal else None,
        "P = exp(S) without subtracting lse: P = exp(Q K^T * sm_scale - lse), the forward's normalization":
            dict(p=lambda s, lse, keep: _masked_p(s, torch.zeros_like(lse), keep)),
        "no softmax scale in S = Q K^T * sm_scale":
            dict(p=lambda s, lse, keep: _masked_p(s / scale, lse, keep)),
        "a softmax scale applied twice in S = Q K^T * sm_scale":
            dict(p=lambda s, lse, keep: _masked_p(s * scale, lse, keep)),
        "the log-sum-exp in the wrong base: the forward's lse is natural (base e), so P = exp(S - lse) "
        "(or exp2(S * log2(e) - lse * log2(e)))":
            dict(p=lambda s, lse, keep: _masked_p(s, lse, keep, torch.exp2)),
        "the log-sum-exp in the wrong base (exp2 of S * log2(e) - lse: convert lse too, or use exp)":
            dict(p=lambda s, lse, keep: _masked_p(s * LOG2E, lse, keep, torch.exp2)),
        "the log-sum-exp of the wrong row: read lse (and D) of the q head h = h_kv * group + g, at "
        "(b * n_heads + h) * n_q + rows, not at the k/v head's index h_kv":
            dict(lse_rows=lambda lse: lse[:, torch.arange(H, device=lse.device) // g]) if g > 1 else None,
    }


def _diagnose_attention(got, q, k, v, do, causal, scale, tol) -> str:
    """What a wrong (dq, dk, dv) most likely did: the float64 answer of each usual mistake, compared."""
    dq, dk, dv = got
    H, H_kv, N, N_kv = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    g = H // H_kv

    def grads(**kw):
        return attention_grads64(q, k, v, do, causal, scale, **kw)

    right = grads()
    unwritten = ("The outputs start as NaN: an element your kernel never stored stays NaN (a row with no "
                 "visible key has dQ = 0, which must be stored too). ")
    if not all(torch.isfinite(t).all() for t in got):
        if causal and N > N_kv:
            return (unwritten + f"NaN or inf in your gradients, with {N - N_kv} query rows that see no key "
                    "(n_q > n_kv, causal): "
                    "their lse is -inf and their P must be 0. Align the mask bottom-right, key j visible from "
                    "query i when j <= i + causal_offset (causal_offset = n_kv - n_q < 0 here), and keep P = 0 "
                    "where masked.")
        return unwritten + "NaN or inf in your gradients: mask every load and keep P = 0 on masked and padded lanes."
    wrong_p = _wrong_p(causal, scale, g, H, N, N_kv)
    if _rel(dv, right[4]) > tol:
        if _rel(dv, right[3]) < tol and _rel(dk, right[4]) < tol:
            return ("dK and dV are swapped: your dV holds dK = sm_scale * dS^T Q and your dK holds dV = P^T dO. "
                    "Store each accumulator through its own pointer (dk_ptr, dv_ptr).")
        if g > 1 and any(_rel(dv, right[6][:, i::g]) < tol for i in (0, g - 1)):
            return (f"dV holds one q head's share: with {H} q heads on {H_kv} k/v heads, every q head of the "
                    "group adds P^T dO into its k/v head's dK and dV (loop over the group, accumulate).")
        for what, kw in wrong_p.items():
            if kw is not None and _rel(dv, grads(**kw)[4]) < tol:
                return f"dV = P^T dO is wrong, and matches P recomputed with {what}."
        return ("dV = P^T dO is wrong, so P is: recompute P = exp(Q K^T * sm_scale - lse) with the lse of the "
                "same (batch, head, query row), in base e, 0 where masked or padded.")
    if _rel(dk, right[3]) > tol and g > 1 and any(_rel(dk, right[5][:, i::g]) < tol for i in (0, g - 1)):
        return (f"dK holds one q head's share: with {H} q heads on {H_kv} k/v heads, sum dS^T Q over the q heads "
                "of the group.")
    if _rel(dq, grads(delta=False)[2]) < tol or _rel(dk, grads(delta=False)[3]) < tol:
        return ("dS without the D term: dS = P * (dP - D) with D = rowsum(dO * O) (exercise 11.1's delta), "
                "one number per query row.")
    for t, r, name in ((dq, right[2], "dQ"), (dk, right[3], "dK")):
        if _rel(t, r / scale) < tol:
            return f"{name} misses the softmax scale: {name} = sm_scale * (...)."
        if _rel(t, r * scale) < tol:
            return f"{name} has the softmax scale twice: multiply by sm_scale once."
    if _rel(dq, right[2]) > tol and _rel(dk, right[3]) <= tol:   # P right in the dK/dV pass: the dQ pass's own P?
        for what, kw in wrong_p.items():
            if kw is not None and _rel(dq, grads(**kw)[2]) < tol:
                return (f"dQ is wrong while dK and dV are right, and matches P recomputed with {what}, in the dQ pass "
                        "only: the dQ pass recomputes P as the dK/dV pass does, with the same mask and lse.")
    bad = [n for t, r, n in ((dq, right[2], "dQ (the dQ pass)"), (dk, right[3], "dK")) if _rel(t, r) > tol]
    return f"{' and '.join(bad)} wrong while dV is right: P is right, check dP = dO V^T, dS, and the product."


def _attention_forbidden() -> dict[str, object]:
    from ..kernels import attention as A
    from ..kernels import attention_backward as AB
    from ..tuned import attention_backward as TB
    return {"FlashAttention backward (teaching)": AB.flash_attention_backward_teaching,
            "FlashAttention backward (tuned)": TB.flash_attention_backward,
            "FlashAttention autograd Function": TB.flash_attention_autograd,
            "dK/dV kernel": AB.attn_bwd_dkdv_kernel, "dQ kernel": AB.attn_bwd_dq_kernel,
            "P recomputation": AB.recompute_p, "delta kernel": AB.attn_bwd_preprocess_kernel,
            "tuned dK/dV kernel": TB.attn_bwd_dkdv_tuned_kernel, "tuned dQ kernel": TB.attn_bwd_dq_tuned_kernel,
            "reference backward": AB.attention_backward_ref, "reference attention": A.attention_ref,
            "torch.autograd.grad": torch.autograd.grad, "torch.autograd.backward": torch.autograd.backward,
            "torch.func.vjp": torch.func.vjp}


def _attention_inputs(shape, dtype, common_key: bool):
    """(q, k, v, do). ``common_key``: keys share a large component COMMON_KEY along axis 0, which Q does
    not have (so S and P do not see it, as softmax ignores a key direction no query reads), and the values
    drift from +DRIFT to -DRIFT along the keys. dQ's axis 0 is then sm_scale * COMMON_KEY * sum_j dS_ij,
    exactly 0 (a row's dS sum to 0), while its partial sums over the first half of the keys are large: a
    float32 accumulator ends near 0, a 16-bit one keeps its partial sums' rounding."""
    B, H, H_kv, N, N_kv, d = shape
    q, k, v, do = (check.randn(s, dtype) for s in ((B, H, N, d), (B, H_kv, N_kv, d), (B, H_kv, N_kv, d),
                                                 (B, H, N, d)))
    if common_key:
        q[..., 0] = 0
        k[..., 0] += COMMON_KEY
        drift = torch.where(torch.arange(N_kv, device=v.device) < N_kv // 2, DRIFT, -DRIFT)
        v += drift[:, None].to(dtype)
    return q, k, v, do


def _guard_loads(case: str, loads, ins) -> None:
    """Fail a load from a guard zone of an input (interpreter): a padded lane that was not masked, or (k and v,
    grouped-query) a q head's index used as the k/v head's."""
    grouped = ins[0].tensor.shape[1] != ins[1].tensor.shape[1]
    for g_, what in zip(ins, ("q", "k", "v", "o", "lse", "do")):
        n = in_guards(loads, g_)
        if n:
            rows = "keys >= n_kv" if what in ("k", "v") else "rows >= n_q"
            head = (f" Or a head past {what}'s last: with grouped-query heads, q head h reads k/v head h // group, "
                    "not h." if grouped and what in ("k", "v") else "")
            raise check.CheckFailure(
                f"{case}: your kernels loaded {n} element(s) outside {what} (past its last row, where a tile's "
                f"padded lanes point): mask every tl.load of {what}, {rows} (other=0.0), in both passes. The "
                "numbers may still be right (those rows are never stored), but past the end of a buffer there "
                f"may be no memory at all.{head}")


def _call(fn, case, inputs, causal, sm_scale, with_out):
    """The student's (dq, dk, dv) and the float64 (dq, dk, dv), after checking the buffers and the loads."""
    q, k, v, do = inputs
    dtype = q.dtype
    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    o, lse, *right = attention_grads64(q, k, v, do, causal, scale)[:5]
    ins = [check.guarded_copy(t) for t in (q, k, v, o.to(dtype), lse.float(), do)]
    outs = {w: check.Guarded(like.shape, dtype) for w, like in (("dq", q), ("dk", k), ("dv", v))}
    try:
        with check.track_loads() as loads:
            got = fn(*(g.tensor for g in ins), causal=causal, sm_scale=sm_scale,
                     **({w: g.tensor for w, g in outs.items()} if with_out else {}))
    except (NotImplementedError, check.CheckFailure):
        raise
    except Exception as e:  # a crash in the student's code: say where
        raise check.CheckFailure(f"{case}: your function raised {type(e).__name__}: {str(e)[:400]}") from e
    for g_, what in zip(ins, ("q", "k", "v", "o", "lse", "do")):
        g_.check(f"{case}, the {what} buffer")
    if with_out:
        for what, g_ in outs.items():
            g_.check(f"{case}, the {what} buffer", "mask every tl.store: rows >= n and columns >= head_dim")
    _guard_loads(case, loads, ins)
    check.require(isinstance(got, (tuple, list)) and len(got) == 3,
                  f"{case}: return (dq, dk, dv), got {type(got).__name__}")
    for t, like, what in zip(got, (q, k, v), ("dq", "dk", "dv")):
        check.require(isinstance(t, torch.Tensor) and t.shape == like.shape and t.dtype == dtype,
                      f"{case}: {what} must have the shape {tuple(like.shape)} and dtype {dtype} of "
                      f"{what[1:]}, got {getattr(t, 'shape', type(t))} {getattr(t, 'dtype', '')}")
    return got, right, scale


TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2}


def _fail(case, errors, tol, cause):
    shown = ", ".join(f"{w} {e:.1e}" for w, e in errors.items())
    raise check.CheckFailure(f"{case}: your gradients differ from the float64 reference (max error / max "
                             f"|reference|: {shown}; tolerance {tol:g}).\nLikely cause: {cause}")


def _tile_skip(got, right, errors, tol, causal_offset) -> str:
    """The cause when one pass is wrong on a few of its rows only, in a causal case: a loop bound that skips
    the tiles the mask hides, off by one ('' when the errors do not look so)."""
    if not all(torch.isfinite(t).all() for t in got):
        return ""
    for i, (what, rows, loop, bound) in enumerate((
            ("dq", "query rows", "dQ pass's key loop", "a query tile [start_m, start_m + BLOCK_M) sees the keys "
             "below start_m + BLOCK_M + causal_offset (exclusive)"),
            ("dk", "keys", "dK/dV pass's query loop", "a key tile [start_n, start_n + BLOCK_N) is seen by the "
             "query rows from start_n - causal_offset on"))):
        others_right = all(e <= tol for w, e in errors.items() if w != what and not (what == "dk" and w == "dv"))
        if errors[what] <= tol or not others_right:
            continue
        err = (got[i].double() - right[i]).abs().amax(-1) / right[i].abs().max().clamp_min(1e-30)
        bad = int((err > tol).sum())
        if 0 < bad <= err.numel() // 8:
            return (f"{what} is wrong on {bad} of {err.numel()} {rows} only, in a causal case with causal_offset = "
                    f"n_kv - n_q = {causal_offset}: the {loop} stops one tile early or starts one late. Query row i "
                    f"sees key j when j <= i + causal_offset, so {bound}; an off-by-one there drops a tile whenever "
                    "causal_offset = 1 (mod the tile size).")
    return ""


def _common_key_case(fn, name, dtype, with_out) -> None:
    """float16 inputs, 128 key tiles of 16, keys with a shared component (see :func:`_attention_inputs`): a
    right kernel's error stays below 2e-3 of the largest |dQ| (float16 tolerance 1e-2), a float16 accumulator's
    above 4e-2 (in 8 emulated and 6 interpreted draws each)."""
    n_q, n_kv, d = COMMON_KEY_CASE
    case = (f"{name} ({_name(dtype)}, q 1x1x{n_q}x{d}, {n_kv} keys sharing a component of {COMMON_KEY:g} along "
            f"axis 0, values drifting from +{DRIFT:g} to -{DRIFT:g}, causal=False)")
    inputs = _attention_inputs((1, 1, 1, n_q, n_kv, d), dtype, common_key=True)
    got, right, scale = _call(fn, case, inputs, False, None, with_out)
    tol = TOLERANCE[dtype]
    errors = {what: _rel(t, r) for what, t, r in zip(("dq", "dk", "dv"), got, right)}
    if max(errors.values()) <= tol:
        return
    if errors["dk"] <= tol and errors["dv"] <= tol:
        cause = (f"dQ's sum over the key tiles lost precision. Its axis 0 here is sm_scale * {COMMON_KEY:g} * "
                 "sum_j dS_ij = 0, but its partial sums over the first key tiles are large: an accumulator in "
                 f"{_name(dtype)} keeps their rounding. Accumulate dQ in float32 (tl.zeros(..., dtype=tl.float32)) "
                 "and cast once, at the store.")
    else:
        cause = _diagnose_attention(got, *inputs, False, scale, max(tol, 2e-3))
    _fail(case, errors, tol, cause)


def check_flash_backward(fn, name: str = "FlashAttention backward") -> None:
    """``fn(q, k, v, o, lse, do, causal, sm_scale[, dq, dk, dv]) -> (dq, dk, dv)`` on contiguous inputs, against
    float64; output buffers, when ``fn`` takes them, are NaN-poisoned inside guard zones; under the interpreter
    no load may read a guard zone of an input."""
    forbidden = _attention_forbidden()
    check.refuse_answer_key(name, fn, forbidden)
    for _ref_name, obj in check._referenced(fn):  # the student's kernels too: their bodies, not only the launcher
        body = getattr(obj, "fn", None)
        if inspect.isfunction(body) and not body.__module__.startswith("course_utils"):
            check.refuse_answer_key(name, body, forbidden)
    with_out = {"dq", "dk", "dv"} <= set(inspect.signature(fn).parameters)  # then outputs start as NaN
    dtypes = env.supported_dtypes()
    for dtype in dtypes:
        # float32 everywhere; the 16-bit dtypes on the causal grouped-query cases
        for (B, H, H_kv, N, N_kv, d, causal, sm_scale) in (ATTN_CASES if dtype == torch.float32 else ATTN_CASES[2:]):
            case = (f"{name} ({_name(dtype)}, q {B}x{H}x{N}x{d}, k/v {H_kv} heads x {N_kv} keys, "
                    f"causal={causal}, sm_scale={sm_scale})")
            inputs = _attention_inputs((B, H, H_kv, N, N_kv, d), dtype, common_key=False)
            got, right, scale = _call(fn, case, inputs, causal, sm_scale, with_out)
            tol = TOLERANCE[dtype]
            errors = {what: _rel(t, r) for what, t, r in zip(("dq", "dk", "dv"), got, right)}
            if max(errors.values()) > tol:
                skip = _tile_skip(got, right, errors, tol, N_kv - N) if causal else ""
                if skip:
                    cause = skip
                elif dtype == torch.float32 and max(errors.values()) < PRECISION_LOSS:
                    cause = ("every gradient is close to the reference, but not float32-accurate: a precision loss, "
                             "not a wrong formula. Pass input_precision=DOT_PRECISION to every tl.dot (on a GPU a "
                             "float32 tl.dot defaults to TF32, 10 bits of mantissa), and cast nothing to a 16-bit "
                             "type on the way.")
                else:
                    cause = _diagnose_attention(got, *inputs, causal, scale, max(tol, 2e-3))
                _fail(case, errors, tol, cause)
        if dtype == torch.float16:  # bfloat16's own rounding, times the shared component, nears its tolerance
            _common_key_case(fn, name, dtype, with_out)
    args = [check.randn(s, dtypes[0]) for s in ((1, 2, 17, 16), (1, 1, 17, 16), (1, 1, 17, 16))]
    o, lse = attention_grads64(*args, args[0], True, 0.25)[:2]
    call = (*args, o.to(dtypes[0]), lse.float(), args[0])
    check.check_kernel_launches(name, fn, *call, expected=3, causal=True, sm_scale=0.25)
    check.verdict(name, "dq, dk and dv match the float64 reference with grouped-query heads, causal masks aligned "
                        "bottom-right (more keys than queries, more queries than keys, an offset of 1 modulo the "
                        "tile), every dtype tried, dQ summed over 2048 keys whose partial sums cancel, no load "
                        "past an input " + LOADS_SEEN + "; three launches of your kernels")
