"""Checkers of chapters 3-4: vector add, the launch grid, fused GELU (the fused chain and dropout: :mod:`.chain`).

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
import os
import random
from collections.abc import Callable

import torch

from .. import check, env
from ..check import CheckFailure, verdict
from ..kernels import elementwise as ew
from . import answer_keys
from .loads import stub_message


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
        if e.__cause__ is not None and stub_message(e.__cause__) is not None:
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
    """When GELU's values differ: if they are another usual formula's, on x spread over [-9, 9] with a few
    elements of magnitude 10 to 120 (where exp(2a) overflows float32), say which."""
    n = 4099
    x = check.randn((n,), torch.float32, scale=3.0)
    big = torch.rand(n, device=x.device) < 0.05
    x = torch.where(big, torch.sign(x) * (10.0 + 110.0 * torch.rand(n, device=x.device)), x)
    got = _call(f"fused GELU (float32, n={n})", gelu, x)
    if not isinstance(got, torch.Tensor) or got.numel() != n:
        return
    g, x64 = got.detach().to("cpu", torch.float64).flatten(), x.to("cpu", torch.float64)
    a = 0.7978845608028654 * (x64 + 0.044715 * x64**3)
    nan = torch.isnan(g)
    if bool(nan.any()) and bool((a[nan].abs() > 40).all()) and bool((a.abs() > 45).any()):
        raise CheckFailure(
            f"fused GELU (float32, n={n}): NaN exactly where |a| is large ({int(nan.sum())} element(s), first at "
            f"x = {float(x64[nan][0]):.4g}): tanh written as (exp(2a) - 1) / (exp(2a) + 1) overflows, since exp(2a) "
            "is inf in float32 once a > 44, and inf / inf = NaN (exp(-2a) does the same for a < -44). Build tanh "
            "from w = tl.exp(-2 * tl.abs(a)), whose argument is never positive, as sign(a) (1 - w) / (1 + w), or "
            "use the sigmoid form x / (1 + tl.exp(-2 * a)).")
    right = ew.gelu_ref(x64, "tanh")
    wrong = {
        "that is the exact GELU, x * Phi(x) with erf: the exercise asks for the tanh approximation, "
        "0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))": torch.nn.functional.gelu(x64),
        "that is half of GELU: the sigmoid form x * sigmoid(2a) has no factor 0.5 (the tanh form "
        "0.5 x (1 + tanh(a)) has one)": 0.5 * right,
        "that is x * sigmoid(a): tanh(a) = 2 sigmoid(2a) - 1, so GELU = x * sigmoid(2a)": x64 * torch.sigmoid(a),
        "the cubic term is 0.044715 x^3, not x^2":
            0.5 * x64 * (1 + torch.tanh(0.7978845608028654 * (x64 + 0.044715 * x64**2))),
        "that is tanh(|a|): the sign of a is lost (negative x give about x instead of about 0). tanh built from "
        "w = exp(-2 |a|) is (1 - w) / (1 + w) for a >= 0 and its negative for a < 0: "
        "tl.where(a < 0, -t, t)": 0.5 * x64 * (1 + torch.tanh(a.abs())),
        "the cubic term sits outside the sqrt(2/pi) factor: a = sqrt(2/pi) * (x + 0.044715 x^3), the factor "
        "multiplies both terms": 0.5 * x64 * (1 + torch.tanh(0.7978845608028654 * x64 + 0.044715 * x64**3)),
        "that is the sigmoid approximation x * sigmoid(1.702 x) (the 'quick GELU'): the exercise asks for the tanh "
        "form, x * sigmoid(2a) with a = sqrt(2 / pi) (x + 0.044715 x^3)": x64 * torch.sigmoid(1.702 * x64),
    }
    atol, rtol = check.tolerance(torch.float32)
    for fault, w in wrong.items():
        if torch.allclose(g, w, atol=atol, rtol=rtol):
            raise CheckFailure(f"fused GELU (float32, n={n}): your values are not the tanh GELU's: {fault}.")


# chapter 4's chain and dropout live in .chain; the notebooks call them from here
from .chain import check_bias_gelu_dropout, check_bias_gelu_scale  # noqa: E402,F401
