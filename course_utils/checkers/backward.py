"""Checks for chapter 11 (the backward pass).
(Exercise 11.3's check, :func:`check_flash_backward`, lives in :mod:`.flash_backward` and is re-exported here.)

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

import torch
import triton

from .. import check, env
from ..kernels import gelu_backward as gb
from ..tuned.elementwise import dropout_keep_mask
from . import offsets64
from .flash_backward import ATTN_CASES, attention_grads64, check_flash_backward  # noqa: F401  (re-exported)


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


def _delta_forbidden() -> dict[str, object]:
    from ..kernels import attention_backward as AB
    from ..tuned import attention_backward as TB
    return {"delta kernel (the answer key)": AB.attn_bwd_preprocess_kernel, "row_delta (the answer key)": AB.row_delta,
            "delta_rows (the answer key)": TB.delta_rows}


def _delta_diagnose(kernel, dtype) -> str:
    """What a wrong delta most likely did, judged on a probe of 64 rows x 80 in ``dtype`` (O's rows 3 apart
    more than dO's, as in the check): "" when no known mistake fits."""
    from .layernorm_backward import _read_with_stride
    n_rows, head_dim = 64, 80
    o, do = (check.randn((n_rows, head_dim + gap), dtype, scale=2.0)[:, :head_dim] for gap in (3, 10))
    delta = torch.full((n_rows,), float("nan"), device=o.device)
    try:
        kernel[(n_rows,)](o, do, delta, head_dim, o.stride(0), do.stride(0), BLOCK_D=triton.next_power_of_2(head_dim))
    except Exception:  # the probe is only for the hint: the failure itself was already reported
        return ""
    got, o64, do64 = delta.to("cpu", torch.float64), o.to("cpu", torch.float64), do.to("cpu", torch.float64)
    right = (o64 * do64).sum(-1)

    def fits(want, rows=n_rows) -> bool:
        return bool(torch.allclose(got[:rows], want[:rows], rtol=1e-3, atol=1e-3 * float(right.abs().max())))
    read = _read_with_stride(do, o.stride(0))   # dO's rows at O's (narrower) stride: inside dO's memory
    if fits((o64[:read.shape[0]] * read).sum(-1), read.shape[0]):
        return ("delta is what dO read with O's row stride gives: each tensor has its own row stride, "
                "dO's row pid at do_ptr + pid * do_row_stride.")
    if fits((_read_with_stride(o, head_dim) * _read_with_stride(do, head_dim)).sum(-1)):
        return ("delta is what O and dO read with their rows head_dim elements apart give, as if they were "
                "contiguous: the check's rows are further apart. Row pid of O is at o_ptr + pid * o_row_stride, "
                "of dO at do_ptr + pid * do_row_stride.")
    if fits(right / head_dim):
        return "delta is the row's sum divided by head_dim (a mean): D is the plain sum, tl.sum(o * do)."
    if fits((o64 * o64).sum(-1)) or fits((do64 * do64).sum(-1)):
        return "delta is rowsum(O * O) or rowsum(dO * dO): D multiplies the two tensors, rowsum(dO * O)."
    if dtype != torch.float32 and int(got.ne(0).sum()) >= 16 and torch.equal(got.to(dtype).double(), got):
        return ("delta is computed in 16 bits: every value is a 16-bit number (a float32 sum lands on one about 1 "
                "time in 2^13), off by the 16-bit rounding of the products and of the running sum. Convert O and dO "
                "with .to(tl.float32) before multiplying.")
    return ""


def check_delta_kernel(kernel, name: str = "FlashAttention backward: delta = rowsum(dO * O)") -> None:
    for fn in (kernel, getattr(kernel, "fn", None)):  # the kernel, and the body of a @triton.jit one
        check.refuse_answer_key(name, fn, _delta_forbidden())
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
            try:
                check.check_loads_inside(case, loads, [o, do])
            except check.CheckFailure:   # a row stride that reaches past a tensor's end: named as such
                from .layernorm_common import _stride_fault
                fault = _stride_fault(loads, {"o": o, "do": do}, {"o_row_stride": o.stride(0),
                                                                  "do_row_stride": do.stride(0), "head_dim": head_dim})
                if fault:
                    raise check.CheckFailure(f"{case}: {fault}") from None
                raise
            delta.check(case, hint)
            expected = (o.double() * do.double()).sum(-1)
            # float32 products summed over head_dim terms: a few float32 ulps of the largest term each
            atol = 1e-5 * head_dim * float((o.double() * do.double()).abs().max())
            try:
                check.compare(case, delta.tensor, expected, dtype=torch.float32, atol=max(atol, 1e-6), hint=hint)
            except check.CheckFailure as e:
                cause = _delta_diagnose(kernel, dtype)
                if not cause:
                    raise
                raise check.CheckFailure(f"{e}\nLikely cause: {cause}") from None
            og.check(f"{case}, O's buffer")
            dg.check(f"{case}, dO's buffer")
    check.verdict(name, "matches the float64 reference on every shape and dtype tried, strided rows, "
                        "no writes outside the output")


def _gelu_tanh(z):
    return torch.nn.functional.gelu(z, approximate="tanh")


def _gelu_grad64(z: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    z64 = z.detach().double().requires_grad_(True)
    (grad,) = torch.autograd.grad(torch.nn.functional.gelu(z64, approximate=approximate), z64, torch.ones_like(z64))
    return grad


def _probe(kernel, block_size: int, p: float):
    """The student's dx on a fixed, larger float32 case (many elements, so that a diagnosis never
    rests on the few elements of a small failing case), with the pieces of the right answer."""
    n_rows, n_cols, seed = 64, 257, 20251124
    x, b, dy = check.randn((n_rows, n_cols), scale=2.0), check.randn((n_cols,)), check.randn((n_rows, n_cols))
    dx = torch.full_like(x, float("nan"))
    kernel[(triton.cdiv(x.numel(), block_size),)](dy, x, b, dx, x.numel(), n_cols, p, seed, BLOCK_SIZE=block_size)
    keep = dropout_keep_mask(x.shape, p, seed, device=x.device)
    return dx.double(), dy.double(), x.double() + b.double(), keep, b.double()


def _diagnose(kernel, block_size: int, p: float) -> str:
    """What a wrong dx most likely did, judged on a probe of 64 x 257 elements."""
    try:
        g, dy, z, keep, b = _probe(kernel, block_size, max(p, 0.3))
    except Exception:  # the probe is only for the hint: the failure itself was already reported
        return "compare your gelu'(z) with the formula above the exercise, with z = x + bias[column]."
    p = max(p, 0.3)
    grad, kept = _gelu_grad64(z), keep.double()

    def matches(candidate) -> bool:
        return bool(torch.isclose(g, candidate, rtol=1e-3, atol=1e-4).double().mean() > 0.99)

    if matches(dy * _gelu_tanh(z) * kept / (1 - p)):
        return "dx looks like dy * gelu(z): the backward multiplies by the derivative gelu'(z), not gelu(z)."
    if matches(dy * _gelu_grad64(z - b) * kept / (1 - p)):
        return "dx is gelu'(x), without the bias: the forward's input is z = x + bias[column], so is gelu'(z)'s."
    s = torch.sigmoid(2 * 0.7978845608028654 * (z + 0.044715 * z ** 3))
    if matches(dy * s * kept / (1 - p)):
        return ("gelu'(z) = s(z) misses the product rule's second term: gelu(z) = z * s(z), so gelu'(z) = s + z * s', "
                "s' = 2 s (1 - s) * sqrt(2/pi) * (1 + 3 * 0.044715 z^2).")
    erf = _gelu_grad64(z, approximate="none")
    if bool(torch.isclose(g, dy * erf * kept / (1 - p), rtol=1e-5, atol=1e-6).double().mean() > 0.99):
        return ("dx uses the erf form of GELU's derivative, Phi(z) + z phi(z): the forward is GELU's tanh "
                "approximation (SQRT_2_OVER_PI, GELU_CUBIC), so the backward is its derivative, s + z * s' with "
                "s = 1 / (1 + exp(-2a)).")
    if matches(dy * grad * (1 - kept) / (1 - p)) or matches(dy * grad * (1 - kept) / p):
        return ("the keep mask is inverted: dx survives where the forward dropped the element. The forward keeps "
                "tl.rand(seed, offsets) >= p (an element survives with probability 1 - p).")
    if matches(dy * grad * kept):
        return "dx is right on kept elements up to a factor 1 - p: multiply kept elements by 1 / (1 - p)."
    if matches(dy * grad * kept * (1 - p)):
        return ("kept elements are multiplied by 1 - p: the forward scaled them by 1 / (1 - p) (inverted dropout), "
                "so the backward divides by 1 - p too.")
    x = z - b
    if matches(dy * _gelu_grad64(x + b[:x.shape[0], None]) * kept / (1 - p)):
        return ("z = x + bias[row]: the bias is indexed by the element's column, bias[offsets % n_cols], not by its "
                "row (offsets // n_cols).")
    cubic = s + z * 2 * s * (1 - s) * 0.7978845608028654 * (1 + 0.044715 * z ** 2)
    if matches(dy * cubic * kept / (1 - p)):
        return ("the derivative of the cubic term lost its 3: a = sqrt(2/pi) * (z + 0.044715 z^3), so "
                "da/dz = sqrt(2/pi) * (1 + 3 * 0.044715 z^2).")
    da = 0.7978845608028654 * (1 + 3 * 0.044715 * z ** 2)
    if matches(dy * (s + z * s * (1 - s) * da) * kept / (1 - p)):
        return ("s' lost its factor 2: s = sigmoid(2a) = 1 / (1 + exp(-2a)), so s' = 2 s (1 - s) * da/dz, "
                "the 2 from the chain rule through 2a.")
    s_a = torch.sigmoid(0.7978845608028654 * (z + 0.044715 * z ** 3))
    if any(matches(dy * (s_a + z * f * s_a * (1 - s_a) * da) * kept / (1 - p)) for f in (1, 2)):
        return ("s is sigmoid(a), not sigmoid(2a): GELU's tanh form is 0.5 z (1 + tanh(a)) = z * sigmoid(2a), so "
                "s = 1 / (1 + exp(-2a)) with a = sqrt(2/pi) (z + 0.044715 z^3).")
    if matches(dy * grad / (1 - p)) or matches(dy * grad):
        return "no element of dx is dropped: regenerate the forward's mask, keep = tl.rand(seed, offsets) >= p."
    dropped = ~keep.bool()
    if float((g[dropped] != 0).double().mean()) > 0.05:
        return ("dx is non-zero where the forward dropped the element: the mask must come from the same "
                "(seed, flat offset) pairs as the forward's, tl.rand(seed, offsets) with the global offsets.")
    return "compare your gelu'(z) with the formula above the exercise, with z = x + bias[column]."


#: float32's error in dx, relative to |dy| / (1 - p): gelu'(z)'s terms are at most about 1, rounded a few times
F32_DX = 2e-5


def _check_rounded_once(case: str, dx: torch.Tensor, expected: torch.Tensor, dy: torch.Tensor, p: float) -> None:
    """A 16-bit dx must be float32 math rounded once, at the store: within half a unit in its last place of the
    float64 answer, plus float32's error (F32_DX). The dtype's tolerance (float16's 2e-3) lets z = x + b added in
    16 bits through: near gelu'(z)'s zero (z about -0.75) z's rounding moves dx by about 1e-4 |dy|."""
    if dx.dtype not in (torch.float16, torch.bfloat16):
        return
    unit = 2.0**-11 if dx.dtype == torch.float16 else 2.0**-8
    got, want = dx.to("cpu", torch.float64), expected.to("cpu", torch.float64)
    bound = unit * want.abs() + F32_DX * dy.to("cpu", torch.float64).abs() / (1 - p) + 1e-7
    bad = (got - want).abs() > bound
    if bool(bad.any()):
        i = tuple(int(v) for v in bad.nonzero()[0])
        raise check.CheckFailure(
            f"{case}: {int(bad.sum())} element(s) of dx are further from the float64 answer than float32 math rounded "
            f"once to {_name(dx.dtype)} (first at {i}: got {float(got[i]):.6g}, expected {float(want[i]):.6g}): the "
            "math ran in 16 bits. Convert x, bias and dy with .to(tl.float32) right after each tl.load, so that z = x "
            "+ b and every step after it are float32, and round once at the store (dx.to(dx_ptr.dtype.element_ty)).")


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
                _check_rounded_once(case, dx.tensor, expected, dy.tensor, p)
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
