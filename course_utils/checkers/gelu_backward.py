"""Exercise 11.2's check (re-exported by :mod:`course_utils.checkers.backward`, which the notebook imports).

:func:`check_gelu_backward_kernel` launches a student's bias + GELU + dropout backward kernel
``kernel[grid](dy_ptr, x_ptr, bias_ptr, dx_ptr, n_elements, n_cols, p, seed, BLOCK_SIZE=...)`` over a flat
contiguous (rows x n_cols) tensor, writing ``dx = dy * gelu'(x + b) * keep / (1 - p)`` with the keep mask of
chapter 4 (``tl.rand(seed, offsets) >= p``) regenerated, not stored. Fresh inputs every call: odd sizes,
outliers, NaN-poisoned guarded outputs, loads outside the inputs refused (interpreter); a case where z = x + b
reaches 1e30, past where z**3 and z * z overflow float32 (an unclamped z gives NaN there, the exercise's
clamp gives exactly 0 or 1, as the float64 answer does); a last case of more than 2**31 elements fails int32
offsets (see :mod:`.offsets64`). A wrong dx is compared with each usual mistake's to name it. The course's
GELU derivative and backward kernel are refused as the answer.
"""

from __future__ import annotations

import numpy as np
import torch
import triton

from .. import check, env
from ..kernels import gelu_backward as gb
from ..tuned.elementwise import dropout_keep_mask
from . import offsets64


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


#: the hint when no named slip matches: the exercise gives gelu(z) and asks for its derivative
DERIVE_AGAIN = ("check your gelu'(z) term by term: gelu(z) = z * s with s = 1 / (1 + exp(-2a)) and "
                "a = sqrt(2/pi) * (z + 0.044715 z^3), so gelu'(z) = s + z * ds/dz (product rule), ds/dz through 2a and "
                "then a (chain rule), with z = x + bias[column].")


def _diagnose(kernel, block_size: int, p: float) -> str:
    """What a wrong dx most likely did, judged on a probe of 64 x 257 elements."""
    try:
        g, dy, z, keep, b = _probe(kernel, block_size, max(p, 0.3))
    except Exception:  # the probe is only for the hint: the failure itself was already reported
        return DERIVE_AGAIN
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
    return DERIVE_AGAIN


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



#: |z| of the huge case: float32 ends at 3.4e38, so z * z * z overflows past |z| of about 6.98e12 (two of them
#: just below, the rest above), 0.044715 z^3 past 1.97e13, z * z past 1.84e19
HUGE_Z = (6.9e12, 6.97e12, 7.1e12, 1e13, 2e13, 1e15, 1.8e19, 1.9e19, 1e20, 1e30)
NO_CLAMP = ("no clamp on z: float32 ends at 3.4e38, so z * z * z is inf once |z| passes about 7e12 (z * z once it "
            "passes 1.8e19), and s (1 - s) = 0 times an infinite polynomial is NaN (0 * inf), as is inf - inf. "
            "In float32 gelu'(z) is exactly 1 for z > 20 and 0 for z < -20, as the float64 answer is: clamp z to "
            "[-20, 20] (tl.minimum(tl.maximum(z, -20.0), 20.0)) before the polynomial")


def _signs(n: int, device) -> torch.Tensor:
    return torch.where(torch.rand(n, device=device) < 0.5, -1.0, 1.0).double()


def _check_huge_z(kernel, name: str, block_size: int, signature: str) -> None:
    """z = x + b at +-HUGE_Z (float32's range; bfloat16's too on a GPU), reached through x in random places and
    through whole columns of the bias, among ordinary values; p = 0. The right dx is dy or 0 there, finite: a
    kernel without the exercise's clamp gives NaN, named as such when every wrong element is a huge one."""
    n_rows, n_cols = 5, 37
    huge = torch.tensor(HUGE_Z, dtype=torch.float64)
    for dtype in (d for d in env.supported_dtypes() if torch.finfo(d).max > 1e30):
        case = f"{name} ({_name(dtype)}, {n_rows} x {n_cols}, p=0.0, |z| up to 1e30)"
        x, b = check.randn((n_rows, n_cols), torch.float64, scale=2.0), check.randn((n_cols,), torch.float64)
        cols = torch.randperm(n_cols, device=x.device)
        b[cols[:len(HUGE_Z)]] = huge.to(x.device) * _signs(len(HUGE_Z), x.device)
        others = cols[len(HUGE_Z):]           # huge x only where the bias is ordinary: x + b stays finite
        rows = torch.randint(0, n_rows, (2 * len(HUGE_Z),), device=x.device)
        x[rows, others[torch.randint(0, len(others), (2 * len(HUGE_Z),), device=x.device)]] = \
            huge.repeat(2).to(x.device) * _signs(2 * len(HUGE_Z), x.device)
        x, b = check.guarded_copy(x.to(dtype)), check.guarded_copy(b.to(dtype))
        dy = check.guarded_copy(check.randn((n_rows, n_cols), dtype))
        dx = check.Guarded((n_rows, n_cols), dtype)
        n, seed = n_rows * n_cols, int(torch.randint(0, 2**31 - 1, ()).item())
        with check.track_loads() as loads, np.errstate(all="ignore"):  # the interpreter's numpy: inf is no warning
            _launch(kernel, (triton.cdiv(n, block_size),), (dy.tensor, x.tensor, b.tensor, dx.tensor, n, n_cols,
                                                            0.0, seed), {"BLOCK_SIZE": block_size}, case, signature)
        check.check_loads_inside(case, loads, [dy.tensor, x.tensor, b.tensor])
        dx.check(case)
        z = x.tensor.double() + b.tensor.double()
        expected = dy.tensor.double() * _gelu_grad64(z)
        try:
            check.compare(case, dx.tensor, expected, dtype=dtype)
        except check.CheckFailure as e:
            atol, rtol = check.tolerance(dtype)
            bad = ~torch.isclose(dx.tensor.double(), expected, rtol=rtol, atol=atol)
            if bool((z.abs()[bad] > 1e12).all()):
                raise check.CheckFailure(f"{e}\nLikely cause: {NO_CLAMP}.") from None
            raise
        for t, what in ((x, "x"), (b, "bias"), (dy, "dy")):
            t.check(f"{case}, the {what} buffer")


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
    _check_huge_z(kernel, name, block_size, signature)
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
