"""Checkers of chapters 3-4: vector add, the launch grid, fused GELU, the fused chain, dropout.

Each check draws fresh random inputs (signed, with large-magnitude outliers where the tanh could
overflow), tries sizes that are not multiples of any block size, writes into NaN-poisoned outputs
inside guard zones, compares with a float64 reference and, since the lesson is fusion, counts the
kernels launched; 16-bit results must be those of float32 math rounded once, at the store. A passing
check prints one deterministic line; a failing one raises
:class:`course_utils.check.CheckFailure` saying where to look.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import math
import os
import random
from collections.abc import Callable

import torch

from .. import check, env
from ..check import CheckFailure, verdict
from ..kernels import elementwise as ew
from ..tuned.elementwise import dropout_keep_mask
from . import answer_keys


def _refuse_course(what: str, fn: Callable) -> None:
    """The course's elementwise kernels, launchers, references and ``gelu_math`` are the answer."""
    answer_keys.refuse(what, fn, answer_keys.course_answers("course_utils.kernels.elementwise",
                                                            "course_utils.tuned.elementwise"))


def _rng() -> random.Random:
    return random.Random(int.from_bytes(os.urandom(8), "little"))


def _takes_out(fn: Callable) -> bool:
    try:
        return "out" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _call(case: str, fn: Callable, *args, out=None, inputs=(), bias=None):
    """Call the student's function; with ``inputs``, fail on any load outside them (interpreter); with
    ``bias`` (one of the inputs, one value per column of the first), name a read past its end first."""
    try:
        with check.track_loads() as loads:
            got = fn(*args, out=out) if out is not None else fn(*args)
    except (NotImplementedError, CheckFailure):
        raise
    except Exception as e:  # the student's code crashed: say where
        raise CheckFailure(f"{case}: your function raised {type(e).__name__}: {e}") from e
    if inputs:
        if bias is not None:
            _check_bias_loads(case, loads, list(inputs), bias)
        check.check_loads_inside(case, loads, list(inputs))
    return got


def _check_bias_loads(case: str, loads, inputs: list, bias: torch.Tensor) -> None:
    """A bias indexed like x (by the flat offset, or by the row) reads past its n_cols values, with its load
    masked: name the index, not a missing mask."""
    from .loads import span

    addr = loads.flat()
    if addr.size == 0:
        return
    lo, hi = span(bias)
    reach = lo + inputs[0].numel() * bias.element_size()
    past = (addr >= hi) & (addr < reach)
    for t in inputs:
        t_lo, t_hi = span(t)
        past &= ~((addr >= t_lo) & (addr < t_hi))
    if past.any():
        raise CheckFailure(f"{case}: your kernel loaded {int(past.sum())} element(s) past the end of bias, which "
                           f"holds one value per column ({bias.numel()} here): index it by the column, "
                           "cols = offsets % n_cols, not by the flat offset or the row.")


def _dname(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _rounded_once(dtype) -> tuple[float, float]:
    """(atol, rtol) of a result computed in float32 and rounded once to the 16-bit ``dtype``: half a unit in
    the last place, plus float32's own error (1e-5 relative; 1e-6 absolute, the tanh form's cancellation where
    GELU is tiny). Rounding an intermediate (x + bias, or a factor of the product) to fp16 or bf16 before the
    end adds a second half unit and fails."""
    return 1e-6, (2.0**-11 if dtype == torch.float16 else 2.0**-8) + 1e-5


ROUNDED_ONCE_HINT = ("a result computed in float32 and rounded once is within half a unit in the last place of "
                     "its dtype: x.to(tl.float32) right after each tl.load (bias too), every step in float32, and "
                     "one rounding at the store (y.to(y_ptr.dtype.element_ty)); an intermediate rounded to the "
                     "input dtype first (x + bias added in float16, a factor cast back before the product) "
                     "rounds twice")


def _check_rounded_once(case: str, got, expected, dtype) -> None:
    """For 16-bit outputs: within half a unit in the last place of the float64 reference (see _rounded_once)."""
    if dtype in (torch.float16, torch.bfloat16):
        atol, rtol = _rounded_once(dtype)
        check.compare(case + ", rounded once", got, expected, dtype=dtype, atol=atol, rtol=rtol,
                      hint=ROUNDED_ONCE_HINT)


# ------------------------------------------------------------------------------ chapter 3

def check_vector_add(add: Callable) -> None:
    """``add(x, y[, out])`` returns x + y for 1-D tensors of any length, in one kernel launch."""
    _refuse_course("vector add", add)
    try:
        check.check_elementwise(
            "vector add", add, lambda a, b: a + b, n_inputs=2, launches=1,
            hint="offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE); mask = offsets < n_elements; "
                 "pass mask= to both tl.load calls and to tl.store.")
    except CheckFailure as e:  # the kernel's untouched stub surfaces as the interpreter's or compiler's error
        if e.__cause__ is not None and "NotImplementedError" in str(e.__cause__):
            raise NotImplementedError("Exercise 3.2: add_kernel still raises NotImplementedError: replace the "
                                      "raise line in the kernel with your masked load, add and store") from e
        raise


def check_n_programs(n_programs: Callable) -> None:
    """``n_programs(n_elements, BLOCK_SIZE)`` is the grid size: enough programs to cover every element."""
    rng = _rng()
    cases = [(1, 1024), (1024, 1024), (1025, 1024), (0, 256), (7, 8)]
    cases += [(rng.randrange(1, 10**7), 2 ** rng.randrange(4, 13)) for _ in range(50)]
    for n, block in cases:
        try:
            got = n_programs(n, block)
        except (NotImplementedError, CheckFailure):
            raise
        except Exception as e:
            raise CheckFailure(f"n_programs({n}, {block}) raised {type(e).__name__}: {e}") from e
        expected = -(-n // block)
        if isinstance(got, bool) or not isinstance(got, int) or got != expected:
            hint = ""
            if isinstance(got, int) and got == n // block:
                hint = " That is n // BLOCK_SIZE: it drops the partial last tile (round up: triton.cdiv)."
            elif isinstance(got, int) and n == 0 and got == 1:
                hint = " With no elements no program is needed: do not force at least one."
            elif isinstance(got, int) and n % block == 0 and got == n // block + 1:
                hint = (" That is one program too many when n_elements is a multiple of BLOCK_SIZE: round up with "
                        "(n_elements + BLOCK_SIZE - 1) // BLOCK_SIZE, or triton.cdiv.")
            elif isinstance(got, tuple):
                hint = " Return the number of programs; the launch wraps it in the grid tuple, (n_programs(...),)."
            elif isinstance(got, float):
                hint = " The grid is a count of programs: return an int."
            elif hasattr(got, "__index__") and not isinstance(got, int) and int(got) == expected:
                hint = f" The count is right but a {type(got).__name__}: return a Python int (int(...))."
            raise CheckFailure(f"n_programs({n}, {block}) returned {got!r}, expected {expected}.{hint}")
    verdict("launch grid", "covers every element with the fewest programs")


# ------------------------------------------------------------------------------ chapter 4

def check_gelu(gelu: Callable) -> None:
    """``gelu(x[, out])``: tanh-approximation GELU, stable for large |x|, any length, one launch.

    Both forms pass: ``0.5 x (1 + tanh(a))`` and ``x * sigmoid(2a) = x / (1 + exp(-2a))`` are the
    same function. The tolerance is absolute where GELU is tiny (x in [-9, -1]): there the tanh form
    in float32 cancels ``1 + tanh(a)`` and keeps almost no correct relative digit, but its error
    stays below ``atol`` (1e-5 in float32); the sigmoid form is accurate there too, and is what the
    course's kernel uses. In 16-bit dtypes the result must also be rounded once (:func:`_rounded_once`):
    float16's own tolerance (2e-3) would let an intermediate rounded to float16 through.
    """
    _refuse_course("fused GELU", gelu)
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):  # the verdict waits for the rounding check below
            check.check_elementwise(
                "fused GELU", gelu, lambda x: ew.gelu_ref(x, "tanh"), outliers=0.02, outlier_scale=120.0,
                launches=1,
                hint="load with the mask, compute in float32 (x.to(tl.float32)), store with the mask; either "
                     "x / (1 + tl.exp(-2 * a)) (clamp a first, or exp overflows to inf and x / inf = 0 is still "
                     "right) or tanh built from tl.exp(-2 * |a|), whose argument is never positive.")
    except CheckFailure as e:
        if "differ" in str(e):
            _name_gelu_fault(gelu)
        raise
    # 16-bit outputs rounded once: the per-dtype tolerance above (2e-3 in fp16) lets a kernel that rounds an
    # intermediate to the input dtype through; x spread over [-9, 9], where GELU bends
    for dtype in env.supported_dtypes():
        if dtype == torch.float32:
            continue
        n = check.odd_sizes()[-1]
        x = check.randn((n,), dtype, scale=3.0, outliers=0.02, outlier_scale=120.0)
        got = _call(f"fused GELU ({_dname(dtype)}, n={n})", gelu, x)
        _check_rounded_once(f"fused GELU ({_dname(dtype)}, n={n})", got, ew.gelu_ref(x.double(), "tanh"), dtype)
    print(printed.getvalue(), end="")


def _name_gelu_fault(gelu: Callable) -> None:
    """When GELU's values differ: if they are another usual formula's, on x spread over [-9, 9], say which."""
    n = 4099
    x = check.randn((n,), torch.float32, scale=3.0)
    got = _call(f"fused GELU (float32, n={n})", gelu, x)
    if not isinstance(got, torch.Tensor) or got.numel() != n:
        return
    g, x64 = got.detach().to("cpu", torch.float64).flatten(), x.to("cpu", torch.float64)
    a = 0.7978845608028654 * (x64 + 0.044715 * x64**3)
    right = ew.gelu_ref(x64, "tanh")
    wrong = {
        "that is the exact GELU, x * Phi(x) with erf: the exercise asks for the tanh approximation, "
        "0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))": torch.nn.functional.gelu(x64),
        "that is half of GELU: the sigmoid form x * sigmoid(2a) has no factor 0.5 (the tanh form "
        "0.5 x (1 + tanh(a)) has one)": 0.5 * right,
        "that is x * sigmoid(a): tanh(a) = 2 sigmoid(2a) - 1, so GELU = x * sigmoid(2a)": x64 * torch.sigmoid(a),
        "the cubic term is 0.044715 x^3, not x^2":
            0.5 * x64 * (1 + torch.tanh(0.7978845608028654 * (x64 + 0.044715 * x64**2))),
    }
    atol, rtol = check.tolerance(torch.float32)
    for fault, w in wrong.items():
        if torch.allclose(g, w, atol=atol, rtol=rtol):
            raise CheckFailure(f"fused GELU (float32, n={n}): your values are not the tanh GELU's: {fault}.")


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
