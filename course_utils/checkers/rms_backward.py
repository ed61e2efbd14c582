"""Chapter 10's RMSNorm backward exercise: dx with rstd recomputed from x (the launch in the check's docstring),
compared with float64 and each usual slip named; moved out of :mod:`.layernorm_backward` (the dw/db reduction),
:mod:`.layernorm` re-exports it. The check first refuses the course's answers handed in or called
(``layernorm_common.refuse``: ``check.refuse_answer_key`` over chapter 10's answer keys, the course's RMSNorm
backward kernels, launchers and references and torch's norms; tests/test_layernorm_checkers.py holds both refusals).
"""

from __future__ import annotations

import torch
import triton

from .. import check, env
from .layernorm_backward import _read_with_stride
from .layernorm_common import (
    EPS,
    EPS_HINT,
    ROWS_GPU,
    _inputs,
    _launch,
    refuse,
    store_stride_fault,
)
from .loads import LOADS_SEEN
from .offsets64 import HINT as WIDE_HINT
from .offsets64 import wide_case, wide_last_row, wide_launch, wide_rows

# --------------------------------------------------------------------------- RMSNorm's backward, rstd recomputed

RMS_HINT = ("recompute rstd = 1 / sqrt(sum(x * x) / n_cols + eps) in float32; with x_hat = x * rstd and g = dy * w, "
            "dx = (g - x_hat * sum(g * x_hat) / n_cols) * rstd (RMSNorm has no mean: no mean(g) term).")


def _rms_dx64(x64, dy64, w64, eps, *, layer_norm=False, c1=True, n=None, c1_n=None, c1_dy=False, last_rstd=True):
    """dx of RMSNorm in float64 (``layer_norm``/``c1``/``n``/``c1_n``/``c1_dy``/``last_rstd``: the known wrong
    formulas, to name them)."""
    n = n or x64.shape[-1]
    xc = x64 - x64.mean(-1, keepdim=True) if layer_norm else x64
    rstd = 1.0 / torch.sqrt((xc * xc).sum(-1, keepdim=True) / n + eps)
    x_hat, g = xc * rstd, dy64 * w64
    dx = g - (x_hat * ((dy64 if c1_dy else g) * x_hat).sum(-1, keepdim=True) / (c1_n or n) if c1 else 0.0)
    dx = dx - g.mean(-1, keepdim=True) if layer_norm else dx
    return dx * rstd if last_rstd else dx


def _rms_diagnose(got, x64, dy64, w64, x=None, dy=None) -> str:
    rows = lambda d: d.abs().amax(-1, keepdim=True).clamp_min(1e-30)  # noqa: E731
    fits = lambda want, sel=slice(None): bool(((got[sel] - want[sel]).abs() / rows(want[sel]) < 1e-2).all())  # noqa: E731
    n = x64.shape[-1]
    if x is not None and dy is not None and x.stride(0) != dy.stride(0) and x.shape[0] > 2:
        for name, other, stride in (("dy", "x", x.stride(0)), ("x", "dy", dy.stride(0))):
            read = _read_with_stride(dy if name == "dy" else x, stride)
            k = read.shape[0]
            want = _rms_dx64(x64[:k], read, w64, EPS) if name == "dy" else _rms_dx64(read, dy64[:k], w64, EPS)
            if k > 2 and fits(want, slice(0, k)):
                return (f"dx is what {name} read with {other}'s row stride gives ({stride} elements between rows, "
                        f"not {name}_row_stride): each tensor has its own row stride.")
    if x64.shape[0] > 3 and any(fits(_rms_dx64(x64, dy64, w64, e), slice(3, None, 4)) for e in (1e-5, 1e-6, 0.0)):
        return EPS_HINT
    if fits(_rms_dx64(x64, dy64, w64, EPS, layer_norm=True)):
        return "this is LayerNorm's dx: RMSNorm subtracts no mean, from x or from g (no mean(g) term)."
    if fits(_rms_dx64(x64, dy64, w64, EPS, c1=False)):
        return ("dx = g * rstd forgets that rstd depends on every x of the row: subtract x_hat * mean(g * x_hat) "
                "from g first.")
    if fits(_rms_dx64(x64, dy64, torch.ones_like(w64), EPS)):
        return "dx leaves out the weight: g = dy * w, the gradient that reaches x_hat, in both terms of dx."
    if fits(_rms_dx64(x64, dy64, torch.ones_like(w64), EPS) * w64):
        return ("w multiplies dx at the end: the weight belongs inside, g = dy * w, and g * x_hat is summed over the "
                "row; dx = (g - x_hat * sum(g * x_hat) / n_cols) * rstd.")
    if fits(_rms_dx64(x64, dy64, w64, EPS, c1_dy=True)):
        return ("the sum in x_hat * mean(g * x_hat) is over dy * x_hat: the weight belongs in it too, g = dy * w is "
                "the gradient that reaches x_hat, in both terms of dx.")
    if fits(_rms_dx64(x64, dy64, w64, EPS, last_rstd=False)):
        return ("dx misses its last factor rstd: x_hat = x * rstd, so dx = (g - x_hat * mean(g * x_hat)) * rstd, "
                "the chain rule through x_hat's factor rstd.")
    if n > 1 and fits(_rms_dx64(x64, dy64, w64, EPS, c1_n=1)):
        return ("the term x_hat * sum(g * x_hat) is not divided by n_cols: it is x_hat times the MEAN of g * x_hat, "
                "sum(g * x_hat) / n_cols.")
    if n != triton.next_power_of_2(n) and fits(_rms_dx64(x64, dy64, w64, EPS, n=triton.next_power_of_2(n))):
        return "the means were divided by BLOCK_SIZE; divide by n_cols (masked lanes are not part of the row)."
    return ""


#: float32's error in RMSNorm's dx, relative to its row's terms (right kernels: below 2.5e-5 in float16)
F32_RMS = 1e-4


def _rms_rounded_once(case: str, got, want, scale, dtype) -> None:
    """A 16-bit dx must be float32 math rounded once at the store: within half a unit in the last place of the
    float64 answer (and half a float16 subnormal step), plus F32_RMS of the row's terms. The dtype's tolerance lets
    g = dy * w taken in 16 bits through (dy and w not converted): about 4e-4 of the terms in float16."""
    if dtype not in (torch.float16, torch.bfloat16):
        return
    unit = 2.0**-11 if dtype == torch.float16 else 2.0**-8
    bad = (got - want).abs() > unit * want.abs() + 2.0**-25 + F32_RMS * scale
    if bool(bad.any()):
        name = str(dtype).removeprefix("torch.")
        raise check.CheckFailure(
            f"{case}: {int(bad.sum())} element(s) of dx are further from the float64 answer than float32 math rounded "
            f"once to {name}: part of the math ran in {name} (g = dy * w with dy and w as loaded, say). Convert x, dy "
            "and w with .to(tl.float32) right after each tl.load and round once, at the store.")


def check_rms_backward_kernel(kernel, name: str = "RMSNorm backward dx, rstd recomputed") -> None:
    """Judge ``kernel[(n_rows,)](dx_ptr, dy_ptr, x_ptr, w_ptr, n_cols, x_row_stride, dy_row_stride,
    dx_row_stride, eps, BLOCK_SIZE=next_power_of_2(n_cols))``, rstd recomputed from x: dx against float64."""
    refuse(name, kernel)
    shapes = env.pick(gpu=ROWS_GPU, cpu=((7, 13), (1, 1), (37, 300)))
    signature = "It is launched as " + check_rms_backward_kernel.__doc__.split("``")[1]
    for dtype in env.supported_dtypes():
        for n_rows, n_cols in shapes:
            case = f"{name} ({str(dtype).removeprefix('torch.')}, {n_rows} rows x {n_cols} cols, eps={EPS:g})"
            xg, x = _inputs(n_rows, n_cols, dtype)
            dy = check.randn((n_rows, n_cols + 3), dtype)[:, :n_cols]
            w = check.randn((n_cols,), dtype, scale=0.5, offset=1.0)
            dx = check.Guarded((n_rows, n_cols), dtype)
            _launch(signature, lambda: kernel[(n_rows,)](dx.tensor, dy, x, w, n_cols, x.stride(0), dy.stride(0),  # noqa: B023
                                                         dx.tensor.stride(0), EPS,
                                                         BLOCK_SIZE=triton.next_power_of_2(n_cols)), case, RMS_HINT,
                    (x, dy, w), {"x": x, "dy": dy}, {"x_row_stride": x.stride(0), "dy_row_stride": dy.stride(0),
                                                     "dx_row_stride": dx.tensor.stride(0), "n_cols": n_cols})
            x64, dy64, w64 = (t.to("cpu", torch.float64) for t in (x, dy, w))
            want = _rms_dx64(x64, dy64, w64, EPS)
            try:
                dx.check(f"{case}, dx", "store dx with mask=offsets < n_cols, row pid at dx_ptr + pid * dx_row_stride")
            except check.CheckFailure:
                fault = store_stride_fault(dx, want, "dx", {"x_row_stride": x.stride(0), "dy_row_stride": dy.stride(0)})
                if fault:
                    raise check.CheckFailure(f"{case}: {fault}") from None
                raise
            # per row (rows differ in scale by 1e4), the size of the terms dx subtracts: float32 rounds those
            rstd = 1.0 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + EPS)
            g, x_hat = dy64 * w64, x64 * rstd
            terms = g.abs() + (x_hat * (g * x_hat).mean(-1, keepdim=True)).abs()
            scale = (rstd * terms).amax(-1, keepdim=True).clamp_min(1e-30)
            got = dx.tensor.to("cpu", torch.float64)
            check.compare(f"{case}: dx (each row divided by the size of its terms)", got / scale, want / scale,
                          dtype=dtype, atol=2 * check.tolerance(dtype)[0], rtol=0.0,
                          hint=_rms_diagnose(got, x64, dy64, w64, x, dy) or RMS_HINT)
            _rms_rounded_once(case, got, want, scale, dtype)
            xg.check(f"{case}, the input buffer")
    _rms_past_2_31(kernel, name, signature)
    check.verdict(name, "dx matches float64: rows around 1000, small rows (eps matters), strided rows, no loads or "
                        "writes outside the tensors " + LOADS_SEEN)


def _rms_past_2_31(kernel, name: str, signature: str) -> None:
    """float16 x, dy and dx whose last row starts past 2**31 elements (``offsets64.wide_rows``): pid times a
    row stride in int32 wraps there, and the kernel reads and writes the padding instead."""
    n_cols = 197
    case = wide_case(name, n_cols)
    x_small, dy_small = (check.randn((3, n_cols), torch.float16, scale=2.0) for _ in range(2))
    w = check.randn((n_cols,), torch.float16, scale=0.5, offset=1.0)

    def run(x, dy, dx):
        x.copy_(x_small)
        dy.copy_(dy_small)
        dx.fill_(float("nan"))
        wide_launch(lambda: kernel[(3,)](dx, dy, x, w, n_cols, x.stride(0), dy.stride(0), dx.stride(0), EPS,
                                         BLOCK_SIZE=triton.next_power_of_2(n_cols)), case, signature)
        return dx.to("cpu", torch.float64)

    with wide_rows(n_cols, ("x", "dy", "dx")) as t:
        if t is None:
            return
        got = run(t.pop("x"), t.pop("dy"), t.pop("dx"))   # the views die with run: the memory goes back at the end
    wide_last_row(case, got, "dx", "x_row_stride (and dy_row_stride, dx_row_stride)")
    want = _rms_dx64(*(v.to("cpu", torch.float64) for v in (x_small, dy_small, w)), EPS)
    check.compare(f"{case}: dx", got, want, dtype=torch.float16, hint=WIDE_HINT.format(what="x_row_stride"))
