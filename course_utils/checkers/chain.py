"""Checkers of chapter 4's fused chain: bias + GELU + scale, and bias + GELU + dropout (the mask drawn in the
kernel). The same protocol as :mod:`.elementwise` (fresh signed inputs of odd shapes, NaN-poisoned outputs
in guard zones, a float64 reference, 16-bit results rounded once, one launch), whose helpers they share.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .. import check, env
from ..check import CheckFailure, verdict
from ..kernels import elementwise as ew
from ..tuned.elementwise import dropout_keep_mask
from .elementwise import _call, _check_rounded_once, _dname, _refuse_course, _rng, _takes_out


def _chain_shapes():
    return env.pick(gpu=[(1, 1), (7, 13), (333, 1001), (1000, 4096), (3, 5, 67)],
                    cpu=[(1, 1), (7, 13), (37, 129), (3, 5, 67)])


def _check_no_input_change(case, xs, befores):
    for x, b in zip(xs, befores, strict=True):
        x.check(f"{case}, an input buffer")
        if not torch.equal(x.tensor, b):
            raise CheckFailure(f"{case}: your function changed its input; it must only write the output")


def _name_chain_fault(case, got, x64, b64, scale, dtype) -> None:
    """If ``got`` is not gelu(x + bias) * scale but one of the usual wrong orders, say which."""
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(x64.shape):
        return
    g = got.detach().to("cpu", torch.float64)
    x64, b64 = x64.cpu(), b64.cpu()

    def gelu(v):
        return ew.gelu_ref(v, "tanh")
    right = gelu(x64 + b64) * scale
    atol, rtol = check.tolerance(dtype)
    if torch.allclose(g, right, atol=atol, rtol=rtol, equal_nan=False):
        return
    rows = torch.arange(x64.numel()).reshape(x64.shape) // x64.shape[-1]
    wrong = {
        "the bias is added after the GELU: gelu(x + bias), the bias goes inside": (gelu(x64) + b64) * scale,
        "the scale is missing: multiply gelu(x + bias) by scale": gelu(x64 + b64),
        "the scale is applied before the GELU: gelu(x + bias) * scale, not gelu((x + bias) * scale)":
            gelu((x64 + b64) * scale),
        "you divided by scale: multiply by it": gelu(x64 + b64) / scale,
        "the bias is indexed by the row: it holds one value per column, cols = offsets % n_cols":
            gelu(x64 + b64[rows % b64.numel()]) * scale,
    }
    for fault, w in wrong.items():
        if not torch.allclose(w, right, atol=atol, rtol=rtol) and torch.allclose(g, w, atol=atol, rtol=rtol):
            raise CheckFailure(f"{case}: your result is not gelu(x + bias) * scale: {fault}.")


def check_bias_gelu_scale(fn: Callable) -> None:
    """``fn(x, bias, scale[, out])`` = gelu(x + bias) * scale, bias one value per column, one launch."""
    _refuse_course("bias + GELU + scale", fn)
    rng = _rng()
    with_out = _takes_out(fn)
    for dtype in env.supported_dtypes():
        for shape in _chain_shapes():
            case = f"bias + GELU + scale ({_dname(dtype)}, shape={shape})"
            x = check.guarded_copy(check.randn(shape, dtype, outliers=0.02))
            b = check.guarded_copy(check.randn((shape[-1],), dtype))
            # |scale| kept away from 1, where a missing scale or a division by it would pass unseen
            scale = rng.choice([-1, 1]) * rng.choice([rng.uniform(0.2, 0.8), rng.uniform(1.25, 3.0)])
            before = [x.tensor.clone(), b.tensor.clone()]
            out = check.Guarded(shape, dtype) if with_out else None
            got = _call(case, fn, x.tensor, b.tensor, scale, out=out.tensor if out else None,
                        inputs=(x.tensor, b.tensor), bias=b.tensor)
            if with_out:
                got = out.tensor if got is None else got
                out.check(case)
            expected = ew.bias_gelu_scale_ref(before[0].double(), before[1].double(), scale)
            _name_chain_fault(case, got, before[0].double(), before[1].double(), scale, dtype)
            check.compare(case, got, expected,
                          hint="bias is indexed by column: cols = offsets % n_cols; add it before the GELU, "
                               "multiply by scale after it, all in float32.")
            _check_rounded_once(case, got, expected, dtype)
            _check_no_input_change(case, [x, b], before)
    x = check.randn((9, 31))
    b = check.randn((31,))
    fn(x, b, 0.5)  # compile first
    check.check_kernel_launches("bias + GELU + scale", fn, x, b, 0.5, expected=1)
    verdict("bias + GELU + scale", "matches the float64 reference on every shape and dtype tried, 1 kernel launch")


def _dropout_case(fn, case, x, b, p, seed, with_out):
    out = check.Guarded(x.shape, x.dtype) if with_out else None
    got = _call(case, fn, x, b, p, seed, out=out.tensor if out else None, inputs=(x, b), bias=b)
    if with_out:
        got = out.tensor if got is None else got
        out.check(case)
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(x.shape):
        raise CheckFailure(f"{case}: expected a tensor of shape {tuple(x.shape)}, got "
                           f"{tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}")
    return got


def _raise_if_periodic(case, zero, decisive, shape, p, seed) -> None:
    """Name a mask that is the reference's first tile over and over (tl.rand(seed, tl.arange(...)))."""
    keep = dropout_keep_mask(shape, p, seed).cpu().flatten()
    kept, d = (~zero).flatten(), decisive.flatten()
    idx = torch.arange(keep.numel())
    for period in (2 ** k for k in range(4, 17)):
        if period < keep.numel() and bool(((kept == keep[idx % period]) | ~d).all()):
            raise CheckFailure(f"{case}: your mask repeats every {period} elements: every tile draws the same "
                               "random numbers. Pass the element's global offsets (pid * BLOCK_SIZE + "
                               "tl.arange(0, BLOCK_SIZE)) to tl.rand, not tl.arange alone.")


def _same_mask_as_reference(case, zero, decisive, shape, p, seed) -> None:
    """The elements kept must be those of ``tl.rand(seed, offsets) >= p`` over the flat offsets."""
    keep = dropout_keep_mask(shape, p, seed).cpu().flatten()
    kept = (~zero).flatten()
    d = decisive.flatten()
    wrong = (kept != keep) & d
    if not wrong.any():
        return
    i = int(wrong.nonzero()[0])
    _raise_if_periodic(case, zero, decisive, shape, p, seed)
    raise CheckFailure(f"{case}: element {i} was {'kept' if kept[i] else 'dropped'}, but tl.rand(seed, offsets) "
                       f">= p {'drops' if kept[i] else 'keeps'} it ({int(wrong.sum())} element(s) differ): draw "
                       "tl.rand(seed, offsets) with the flat element offsets and keep where it is >= p.")


def check_bias_gelu_dropout(fn: Callable) -> None:
    """``fn(x, bias, p, seed[, out])`` = dropout(gelu(x + bias), p) with the mask drawn in the kernel.

    Judged on: every element is 0 or gelu(x + bias) / (1 - p); the kept fraction is 1 - p (within
    6 standard deviations); neighbouring elements are independent; the elements kept are those
    ``tl.rand(seed, offsets) >= p`` keeps (a mask that repeats every tile is named); the same seed
    gives the same output and another seed another mask; one launch of the student's kernel.
    """
    _refuse_course("bias + GELU + dropout", fn)
    rng = _rng()
    with_out = _takes_out(fn)
    rows = env.pick(gpu=512, cpu=48)
    for dtype in env.supported_dtypes():
        for p in (0.1, 0.5):
            case = f"bias + GELU + dropout ({_dname(dtype)}, p={p})"
            shape = (rows, 257)
            x = check.randn(shape, dtype, scale=2.0, offset=3.0)  # mostly positive: few GELU zeros
            b = check.randn((shape[-1],), dtype)
            seed = rng.randrange(2**31)
            got = _dropout_case(fn, case, x, b, p, seed, with_out)
            ref = torch.nn.functional.gelu(x.double() + b.double(), approximate="tanh")
            kept_value = ref / (1 - p)
            g = got.detach().to("cpu", torch.float64)
            ref_c, kv = ref.cpu(), kept_value.cpu()
            if g.isnan().any():
                i = int(g.isnan().flatten().nonzero()[0])
                raise CheckFailure(f"{case}: element {i} is NaN (still the poison, or the math overflowed): "
                                   "does the grid cover every element and does every lane store?")
            atol, rtol = check.tolerance(dtype)
            zero = g == 0
            close = torch.isclose(g, kv, rtol=rtol, atol=atol)
            bad = ~(zero | close)
            if bad.any():
                i = int(bad.flatten().nonzero()[0])
                gv, kvv, rv = float(g.flatten()[i]), float(kv.flatten()[i]), float(ref_c.flatten()[i])
                hint = ""
                if math.isclose(gv, rv, rel_tol=rtol, abs_tol=atol):
                    hint = " You kept it unscaled: kept elements must be divided by (1 - p)."
                elif math.isclose(gv, rv / p, rel_tol=rtol, abs_tol=atol):
                    hint = (" You divided it by p: divide the kept elements by 1 - p, the probability of keeping "
                            "one, so the expected value is unchanged.")
                elif math.isclose(gv, rv * (1 - p), rel_tol=rtol, abs_tol=atol):
                    hint = " You multiplied it by (1 - p): divide the kept elements by (1 - p) instead."
                raise CheckFailure(f"{case}: element {i} is {gv:.6g}; it must be 0 (dropped) or "
                                   f"gelu(x + bias) / (1 - p) = {kvv:.6g} (kept).{hint}")
            if dtype != torch.float32:  # the kept elements rounded once (the dropped ones are 0 exactly)
                _check_rounded_once(case + ", the kept elements", torch.where(zero, kv, g), kv, dtype)
            decisive = ref_c.abs() > 1e-2          # where 0 and the kept value cannot be confused
            flat = (~zero).flatten()[decisive.flatten()]
            same = float((flat[1:] == flat[:-1]).double().mean())
            expect_same = p * p + (1 - p) * (1 - p)
            if same > expect_same + 0.1:
                raise CheckFailure(f"{case}: neighbouring elements share their fate far too often ({same:.2f} "
                                   f"vs {expect_same:.2f} for independent draws): draw one random number per "
                                   "element, tl.rand(seed, offsets), not one per program.")
            kept = (~zero)[decisive]
            n = int(decisive.sum())
            rate = float(kept.double().mean())
            sigma = math.sqrt(p * (1 - p) / n)
            if abs(rate - (1 - p)) > 6 * sigma + 1e-3:
                _raise_if_periodic(case, zero, decisive, shape, p, seed)  # one tile's rate, repeated
                raise CheckFailure(f"{case}: kept {rate:.3f} of the elements, expected {1 - p:.3f}. "
                                   "Keep an element when its random number is >= p (tl.rand is uniform "
                                   "in [0, 1)).")
            again = _dropout_case(fn, case + ", same seed again", x, b, p, seed, with_out)
            if not torch.equal(again.cpu(), got.cpu()):
                raise CheckFailure(f"{case}: the same seed gave a different output: the mask must be a "
                                   "function of (seed, element index) only.")
            other = _dropout_case(fn, case + ", another seed", x, b, p, seed + 1, with_out)
            if torch.equal((other == 0).cpu(), zero):
                raise CheckFailure(f"{case}: seeds {seed} and {seed + 1} dropped the same elements: pass the "
                                   "seed to tl.rand.")
            _same_mask_as_reference(case, zero, decisive, shape, p, seed)
    x = check.randn((9, 31))
    b = check.randn((31,))
    fn(x, b, 0.5, 1)  # compile first
    check.check_kernel_launches("bias + GELU + dropout", fn, x, b, 0.5, 1, expected=1)
    verdict("bias + GELU + dropout", "0 or gelu(x + bias) / (1 - p) everywhere, keep rate 1 - p, "
            "reproducible from the seed, 1 kernel launch")
