"""Checks for chapter 11 (the backward pass).
(Over 350 lines: chapter 11's three exercises share one refusal, one guard-zone and load-tracking setup and the case
past 2**31 elements; the next split is one module per exercise.)

- :func:`check_delta_kernel` launches a student's FlashAttention-backward preprocessing kernel
  ``kernel[(n_rows,)](o_ptr, do_ptr, delta_ptr, head_dim, o_row_stride, do_row_stride, BLOCK_D=...)``
  that writes ``delta[i] = sum_j O[i, j] * dO[i, j]`` (float32).
- :func:`check_gelu_backward_kernel` launches a student's bias + GELU + dropout backward kernel
  ``kernel[grid](dy_ptr, x_ptr, bias_ptr, dx_ptr, n_elements, n_cols, p, seed, BLOCK_SIZE=...)``
  over a flat contiguous (rows x n_cols) tensor, writing ``dx = dy * gelu'(x + b) * keep / (1 - p)``
  with the keep mask of chapter 4 (``tl.rand(seed, offsets) >= p``) regenerated, not stored; a last case
  of more than 2**31 elements fails int32 offsets (see :mod:`.offsets64`).
- :func:`check_flash_backward` calls a student's ``flash_backward(q, k, v, o, lse, do, causal, sm_scale)``
  (their 11.1 delta kernel, dK/dV pass and dQ pass) on contiguous inputs: one head, grouped-query 4/1 and
  4/2, causal with more keys than queries and more queries than keys, and with an offset n_kv - n_q = 1
  modulo the tile (where a causal tile skip off by one drops a tile), a random dO (so D != 0); in float16
  2048 keys whose dQ partial sums cancel (a 16-bit dQ accumulator fails it); a wrong answer
  is compared with the float64 answer of each usual mistake to name it; three launches.

The course's kernels (inside the student's too), references and torch.autograd are refused as the answer;
the checkers fail a load outside the inputs (interpreter: 11.1 and 11.2 outside every input, 11.3 in the
guard zones around them, as its own D buffer lies elsewhere). Fresh inputs every call: odd sizes, rows
read through strides wider than the row (the gap holds huge values), NaN-poisoned guarded outputs.
"""

from __future__ import annotations

import inspect

import torch
import triton

from .. import check, env
from ..kernels import gelu_backward as gb
from ..tuned.elementwise import dropout_keep_mask
from . import offsets64
from .loads import in_guards


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _launch(kernel, grid, args, kwargs, case: str, signature: str) -> None:
    try:
        kernel[grid](*args, **kwargs)
    except (NotImplementedError, check.CheckFailure):
        raise
    except Exception as e:  # a crash in the student's kernel: say where
        raise check.CheckFailure(f"{case}: your kernel raised {type(e).__name__}: {str(e)[:400]}\n"
                                 f"It is launched as {signature}.") from e


def _strided(n_rows: int, n_cols: int, dtype, gap: int):
    """(n_rows, n_cols) inside a guarded (n_rows, n_cols + gap) buffer whose gap holds +-3e4."""
    full = check.randn((n_rows, n_cols + gap), dtype, scale=2.0)
    full[:, n_cols:] = torch.where(torch.rand(n_rows, gap, device=full.device) < 0.5, 3e4, -3e4).to(dtype)
    g = check.guarded_copy(full)
    return g, g.tensor[:, :n_cols]


def check_delta_kernel(kernel, name: str = "FlashAttention backward: delta = rowsum(dO * O)") -> None:
    shapes = env.pick(gpu=((1, 1), (7, 40), (333, 80), (1000, 96), (129, 128)),
                      cpu=((1, 1), (7, 40), (33, 80), (65, 96)))
    hint = ("program pid owns row pid: load O and dO with mask=offsets < head_dim (other=0), each through "
            "its own row stride, multiply in float32 and tl.sum the row.")
    signature = "kernel[(n_rows,)](o, do, delta, head_dim, o.stride(0), do.stride(0), BLOCK_D=...)"
    for dtype in env.supported_dtypes():
        for n_rows, head_dim in shapes:
            case = f"{name} ({_name(dtype)}, {n_rows} rows, head_dim={head_dim})"
            og, o = _strided(n_rows, head_dim, dtype, gap=3)
            dg, do = _strided(n_rows, head_dim, dtype, gap=7)   # another stride than O's
            delta = check.Guarded((n_rows,), torch.float32)
            with check.track_loads() as loads:
                _launch(kernel, (n_rows,), (o, do, delta.tensor, head_dim, o.stride(0), do.stride(0)),
                        {"BLOCK_D": triton.next_power_of_2(head_dim)}, case, signature)
            check.check_loads_inside(case, loads, [o, do])
            delta.check(case, hint)
            expected = (o.double() * do.double()).sum(-1)
            # float32 products summed over head_dim terms: a few float32 ulps of the largest term each
            atol = 1e-5 * head_dim * float((o.double() * do.double()).abs().max())
            check.compare(case, delta.tensor, expected, dtype=torch.float32, atol=max(atol, 1e-6), hint=hint)
            og.check(f"{case}, O's buffer")
            dg.check(f"{case}, dO's buffer")
    check.verdict(name, "matches the float64 reference on every shape and dtype tried, strided rows, "
                        "no writes outside the output")


def _gelu_tanh(z):
    return torch.nn.functional.gelu(z, approximate="tanh")


def _gelu_grad64(z: torch.Tensor) -> torch.Tensor:
    z64 = z.detach().double().requires_grad_(True)
    (grad,) = torch.autograd.grad(_gelu_tanh(z64), z64, torch.ones_like(z64))
    return grad


def _probe(kernel, block_size: int, p: float):
    """The student's dx on a fixed, larger float32 case (many elements, so that a diagnosis never
    rests on the few elements of a small failing case), with the pieces of the right answer."""
    n_rows, n_cols, seed = 64, 257, 20251124
    x, b, dy = check.randn((n_rows, n_cols), scale=2.0), check.randn((n_cols,)), check.randn((n_rows, n_cols))
    dx = torch.full_like(x, float("nan"))
    kernel[(triton.cdiv(x.numel(), block_size),)](dy, x, b, dx, x.numel(), n_cols, p, seed, BLOCK_SIZE=block_size)
    keep = dropout_keep_mask(x.shape, p, seed, device=x.device)
    return dx.double(), dy.double(), x.double() + b.double(), keep


def _diagnose(kernel, block_size: int, p: float) -> str:
    """What a wrong dx most likely did, judged on a probe of 64 x 257 elements."""
    try:
        g, dy, z, keep = _probe(kernel, block_size, max(p, 0.3))
    except Exception:  # the probe is only for the hint: the failure itself was already reported
        return "compare your gelu'(z) with the formula above the exercise, with z = x + bias[column]."
    p = max(p, 0.3)
    grad, kept = _gelu_grad64(z), keep.double()

    def matches(candidate) -> bool:
        return bool(torch.isclose(g, candidate, rtol=1e-3, atol=1e-4).double().mean() > 0.99)

    if matches(dy * _gelu_tanh(z) * kept / (1 - p)):
        return "dx looks like dy * gelu(z): the backward multiplies by the derivative gelu'(z), not gelu(z)."
    if matches(dy * grad * kept):
        return "dx is right on kept elements up to a factor 1 - p: multiply kept elements by 1 / (1 - p)."
    if matches(dy * grad / (1 - p)) or matches(dy * grad):
        return "no element of dx is dropped: regenerate the forward's mask, keep = tl.rand(seed, offsets) >= p."
    dropped = ~keep.bool()
    if float((g[dropped] != 0).double().mean()) > 0.05:
        return ("dx is non-zero where the forward dropped the element: the mask must come from the same "
                "(seed, flat offset) pairs as the forward's, tl.rand(seed, offsets) with the global offsets.")
    return "compare your gelu'(z) with the formula above the exercise, with z = x + bias[column]."


def check_gelu_backward_kernel(kernel, name: str = "bias + GELU + dropout backward", block_size: int = 256) -> None:
    sizes = env.pick(gpu=((1, 1), (7, 13), (333, 1000), (129, 4097)), cpu=((1, 1), (7, 13), (33, 300), (9, 1001)))
    p_values = (0.0, 0.2, 0.5)
    signature = "kernel[(triton.cdiv(n, BLOCK_SIZE),)](dy, x, bias, dx, n, n_cols, p, seed, BLOCK_SIZE=...)"
    forbidden = {"GELU derivative": gb.gelu_grad, "bias + GELU backward kernel": gb.bias_gelu_backward_kernel}
    for fn in (kernel, getattr(kernel, "fn", None)):  # the kernel, and the body of a @triton.jit one
        check.refuse_answer_key(name, fn, forbidden)
    for dtype in env.supported_dtypes():
        for (n_rows, n_cols) in sizes:
            for p in p_values:
                seed = int(torch.randint(0, 2**31 - 1, ()).item())
                case = f"{name} ({_name(dtype)}, {n_rows} x {n_cols}, p={p})"
                x = check.guarded_copy(check.randn((n_rows, n_cols), dtype, scale=2.0, outliers=0.01,
                                                   outlier_scale=50.0))
                b = check.guarded_copy(check.randn((n_cols,), dtype))
                dy = check.guarded_copy(check.randn((n_rows, n_cols), dtype))
                dx = check.Guarded((n_rows, n_cols), dtype)
                n = n_rows * n_cols
                with check.track_loads() as loads:
                    _launch(kernel, (triton.cdiv(n, block_size),),
                            (dy.tensor, x.tensor, b.tensor, dx.tensor, n, n_cols, p, seed),
                            {"BLOCK_SIZE": block_size}, case, signature)
                check.check_loads_inside(case, loads, [dy.tensor, x.tensor, b.tensor])
                dx.check(case)
                keep = dropout_keep_mask((n_rows, n_cols), p, seed, device=x.tensor.device)
                z = x.tensor.double() + b.tensor.double()
                expected = dy.tensor.double() * _gelu_grad64(z) * keep.double() / (1 - p)
                try:
                    check.compare(case, dx.tensor, expected, dtype=dtype)
                except check.CheckFailure as e:
                    cause = _diagnose(kernel, block_size, p)
                    raise check.CheckFailure(f"{e}\nLikely cause: {cause}") from None
                for t, what in ((x, "x"), (b, "bias"), (dy, "dy")):
                    t.check(f"{case}, the {what} buffer")
    _check_past_2_31(kernel, name, block_size, signature)
    check.verdict(name, "matches the float64 reference with the forward's own dropout mask on every size, "
                        "dtype and p tried, no writes outside dx, offsets past 2**31 elements")


def _check_past_2_31(kernel, name: str, block_size: int, signature: str) -> None:
    """float16, rows x n_cols > 2**31 + 3 tiles, in place (dy = x = dx: each program reads its tile, then
    writes it) after 2**31 elements of padding, so that an int32 offset, which wraps about 2**32 elements
    back, reads and writes the padding: 8 GiB. The last three programs are checked (all that run
    interpreted); p = 0, so that the right answer needs no mask generator for offsets that large."""
    n_cols = 3001
    n_rows = (2**31 + 3 * block_size) // n_cols + 1
    n, n_programs = n_rows * n_cols, triton.cdiv(n_rows * n_cols, block_size)
    first = (n_programs - 3) * block_size                   # > 2**31: every offset of the last programs
    case = f"{name} (float16, {n_rows} x {n_cols} = {n} elements, past 2**31)"
    b = check.guarded_copy(check.randn((n_cols,), torch.float16))
    with offsets64.wide_buffer(2**31 + n, torch.float16) as buf:
        if buf is None:
            return
        x = buf[2**31:]
        x[first:] = check.randn((n - first,), torch.float16, scale=2.0)
        tail = x[first:].clone()
        try:
            ran = offsets64.launch_last_programs(kernel, n_programs, 3, (x, x, b.tensor, x, n, n_cols, 0.0, 1234),
                                                 {"BLOCK_SIZE": block_size})
        except (NotImplementedError, check.CheckFailure):
            raise
        except Exception as e:  # a crash in the student's kernel: say where
            raise check.CheckFailure(f"{case}: your kernel raised {type(e).__name__}: {str(e)[:400]}\n"
                                     f"It is launched as {signature}.") from e
        got = x[first:].clone()
        del x, buf  # the memory goes back to the card as the block ends
    if not ran:
        return
    cols = torch.arange(first, n, device=tail.device) % n_cols
    expected = tail.double() * _gelu_grad64(tail.double() + b.tensor.double()[cols])
    hint = offsets64.HINT.format(what="BLOCK_SIZE")
    if torch.equal(got, tail):
        raise check.CheckFailure(f"{case}: the last tiles (offsets past 2**31) were never written: {hint}.")
    check.compare(case, got, expected, dtype=torch.float16, hint=hint)


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
    if _rel(dv, right[4]) > tol:
        if _rel(dv, right[3]) < tol and _rel(dk, right[4]) < tol:
            return ("dK and dV are swapped: your dV holds dK = sm_scale * dS^T Q and your dK holds dV = P^T dO. "
                    "Store each accumulator through its own pointer (dk_ptr, dv_ptr).")
        if g > 1 and any(_rel(dv, right[6][:, i::g]) < tol for i in (0, g - 1)):
            return (f"dV holds one q head's share: with {H} q heads on {H_kv} k/v heads, every q head of the "
                    "group adds P^T dO into its k/v head's dK and dV (loop over the group, accumulate).")
        wrong_p = {
            "a top-left causal mask: the course aligns it bottom-right (key j visible from query i when "
            "j <= i + causal_offset, causal_offset = n_kv - n_q), as FlashAttention does":
                dict(p=lambda s, lse, keep: _masked_p(s, lse, torch.ones_like(keep).tril(0))) if causal else None,
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
    """Fail a load from a guard zone of an input (interpreter): a padded lane that was not masked."""
    for g_, what in zip(ins, ("q", "k", "v", "o", "lse", "do")):
        n = in_guards(loads, g_)
        if n:
            rows = "keys >= n_kv" if what in ("k", "v") else "rows >= n_q"
            raise check.CheckFailure(
                f"{case}: your kernels loaded {n} element(s) outside {what} (past its last row, where a tile's "
                f"padded lanes point): mask every tl.load of {what}, {rows} (other=0.0), in both passes. The "
                "numbers may still be right (those rows are never stored), but past the end of a buffer there "
                "may be no memory at all.")


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
                        "past an input; three launches of your kernels")
