"""Checks for chapter 9 (a matmul and its fused bias + GELU epilogue).

:func:`check_matmul` judges ``fn(a, b) -> a @ b`` and :func:`check_linear_gelu` judges
``fn(x, w, b) -> gelu(x @ w + b)`` (tanh GELU, bias per output column). Every call draws fresh signed
inputs; the cases go from sizes that are multiples of any tile to ragged M and N, a ragged K, odd
sizes down to 1 and transposed operands (a view with stride 1 along its first dimension). Inputs sit
inside guard zones (an out-of-bounds read brings in garbage), the output is compared with a float64
reference of the same rounded inputs, and the function must launch exactly one Triton kernel. When a
case fails the checker tries the usual faults against the output and names the one that fits.
"""

from __future__ import annotations

import re

import numpy as np
import torch
import torch.nn.functional as F

from .. import check, env

# (atol per sqrt(K), rtol): a K-long sum of products of N(0, 1) numbers is about sqrt(K) in size; the
# output is rounded to its dtype once. On a GPU a float32 tl.dot runs in tf32 (10-bit mantissa) unless
# told otherwise, so float32 is judged at tf32's precision there.
GEMM_TOLERANCES = {
    torch.float32: (2e-3, 5e-3) if env.on_gpu() else (2e-6, 1e-5),
    torch.float16: (1e-3, 2e-3),
    torch.bfloat16: (8e-3, 1.6e-2),
}
FP16_MAX = 65504.0


def cases():
    """(what, M, N, K, transposed) with M <= N so that a bias indexed by row stays inside its buffer."""
    if env.on_gpu():
        return [("sizes that are multiples of every tile", 256, 256, 512, False),
                ("ragged M and N", 201, 333, 512, False), ("ragged K", 40, 96, 333, False),
                ("odd M, N and K", 1, 7, 77, False), ("odd M, N and K", 97, 1003, 1001, False),
                ("transposed operands", 131, 257, 259, True)]
    return [("sizes that are multiples of every tile", 32, 64, 256, False), ("ragged M and N", 23, 45, 256, False),
            ("ragged K", 24, 32, 77, False), ("odd M, N and K", 1, 7, 37, False),
            ("odd M, N and K", 19, 33, 51, False), ("transposed operands", 21, 34, 45, True)]


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _operands(m, n, k, dtype, transposed, cancelling=False):
    gen = check.generator()
    a = check.randn((m, k), torch.float32, gen=gen)
    b = check.randn((k, n), torch.float32, gen=gen)
    if cancelling:
        # every product is about +256 over the first half of K and -256 over the second: the running
        # sum climbs past float16's largest value (65504) and comes back to a small result
        a = 16.0 + 0.25 * a
        b = torch.cat([16.0 + 0.25 * b[: k // 2], -16.0 + 0.25 * b[k // 2:]])
    a, b = a.to(dtype), b.to(dtype)
    if transposed:  # the same values, stored column by column
        a, b = a.T.contiguous().T, b.T.contiguous().T
    return a, b


def _guarded(t: torch.Tensor) -> check.Guarded:
    """``t`` inside guard zones with its own strides (a transposed view stays transposed)."""
    if t.stride(0) == 1 and t.dim() == 2 and t.shape[1] > 1:
        g = check.guarded_copy(t.T.contiguous())
        g.view = g.tensor.T
    else:
        g = check.guarded_copy(t.contiguous())
        g.view = g.tensor
    return g


def _call(fn, args, case):
    try:
        with np.errstate(over="ignore"):   # the interpreter's exp overflows to inf in GELU: on purpose
            return fn(*args)
    except (NotImplementedError, check.CheckFailure):
        raise
    except Exception as e:
        if "NotImplementedError" in repr(e):  # the interpreter wraps what a kernel raises
            found = re.search(r"NotImplementedError\((['\"])(.*?)\1\)", str(e))
            raise NotImplementedError(found.group(2) if found else f"not done yet ({e})") from None
        raise check.CheckFailure(f"{case}: your function raised {type(e).__name__}: {e}") from e


def _close(got, expected, atol, rtol) -> bool:
    g = got.detach().to("cpu", torch.float64)
    return bool(torch.isclose(g, expected.cpu(), atol=atol, rtol=rtol).all())


def _diagnose(got, acc, bias, atol, rtol, what, earlier_passed) -> str:
    """The usual fault that explains ``got``, as a hint ('' when none fits)."""
    g = got.detach().to("cpu", torch.float64)
    acc = acc.cpu()
    ref = acc if bias is None else F.gelu(acc + bias.cpu(), approximate="tanh")
    if bias is not None:
        b = bias.cpu()
        m = acc.shape[0]
        faults = [
            ("the bias is added along the wrong axis: it has one value per output column (N of them), so "
             "load it with the column offsets (offs_n) and broadcast it over the rows, bias[None, :]",
             F.gelu(acc + b[:m, None], approximate="tanh") if m <= b.numel() else acc),
            ("GELU is applied before the bias: the epilogue is gelu(acc + bias), so add the bias first",
             F.gelu(acc, approximate="tanh") + b),
            ("the bias is missing: add it to the accumulator before GELU", F.gelu(acc, approximate="tanh")),
            ("GELU is missing: apply gelu_math(acc + bias, True) before the store", acc + b),
            ("this is the exact (erf) GELU: the course's epilogue uses the tanh form, gelu_math(..., True)",
             F.gelu(acc + b)),
        ]
        if m > b.numel():
            faults = faults[1:]
        for hint, candidate in faults:
            if torch.isclose(g, candidate, atol=atol, rtol=rtol).all():
                return hint
    finite = torch.isfinite(g)
    if not bool(finite.all()) and bool(torch.isfinite(ref).all()):
        if "cancelling" in what:
            return ("the sum overflowed: it climbs past float16's largest value (65504) in the middle of the K "
                    "loop. Accumulate in float32 (tl.zeros(..., dtype=tl.float32)) and convert once, at the store")
        if "ragged K" in what and earlier_passed:
            return ("the K mask is missing: the last K tile reads past column K of a and row K of b (into "
                    "whatever lies there). Mask both loads with k < K and other=0.0")
    scale = float(ref.abs().max()) or 1.0
    rel = float((g - ref).abs().nan_to_num(float("inf")).max()) / scale
    if rel < 0.05:
        return ("close but not within tolerance: the sum lost precision. Accumulate in float32 "
                "(tl.zeros(..., dtype=tl.float32), tl.dot(a, b, acc)) and round to the output dtype once, at the store")
    if "ragged K" in what and earlier_passed:
        return ("the K mask is missing: every case whose K is a multiple of the tile passes, this one does not. "
                "The last K tile reads past K: mask both loads with k < K and other=0.0")
    if "transposed" in what:
        return "use the strides you are given (stride_am, stride_ak, ...): never assume a row-major operand"
    if "ragged M and N" in what:
        return "mask the rows (offs_m < M) and columns (offs_n < N) of the loads and of the store"
    return ""


def _check(fn, name: str, with_bias: bool, dtypes, hint: str) -> None:
    dtypes = tuple(dtypes or env.supported_dtypes())
    for dtype in dtypes:
        per_sqrt_k, rtol = GEMM_TOLERANCES[dtype]
        todo = list(cases())
        if dtype == torch.float16:
            k = 640 if env.on_gpu() else 576
            todo.insert(1, ("cancelling sums that pass 65504 in the middle of the K loop", 16, 32, k, False))
        passed = 0
        for what, m, n, k, transposed in todo:
            case = f"{name} ({_name(dtype)}, M={m}, N={n}, K={k}, {what})"
            a, b = _operands(m, n, k, dtype, transposed, cancelling="cancelling" in what)
            bias = check.randn((n,), dtype) if with_bias else None
            ga, gb = _guarded(a), _guarded(b)
            args = (ga.view, gb.view) if bias is None else (ga.view, gb.view, check.guarded_copy(bias).tensor)
            got = _call(fn, args, case)
            if not isinstance(got, torch.Tensor) or tuple(got.shape) != (m, n):
                raise check.CheckFailure(f"{case}: expected a {m} x {n} tensor, got "
                                         f"{tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}")
            for g, t, which in ((ga, a, "a"), (gb, b, "b")):
                g.check(f"{case}, input {which}")
                check.require(torch.equal(g.view, t), f"{case}: your function changed its input {which}")
            acc = a.double() @ b.double()
            expected = acc if bias is None else F.gelu(acc + bias.double(), approximate="tanh")
            atol = per_sqrt_k * (k ** 0.5) * (16 if "cancelling" in what else 1)
            if not _close(got, expected, atol, rtol):
                fault = _diagnose(got, acc, None if bias is None else bias.double(), atol, rtol, what, passed > 0)
                check.compare(case, got, expected, dtype=dtype, atol=atol, rtol=rtol, hint=fault or hint)
            passed += 1
    # one Triton kernel: the product and its epilogue in a single launch (torch.empty for the output is fine)
    dtype = dtypes[0]
    a, b = _operands(33, 40, 48, dtype, False)
    args = (a, b) if not with_bias else (a, b, check.randn((40,), dtype))
    with np.errstate(over="ignore"):
        try:
            check.check_kernel_launches(name, fn, *args, expected=1)
        except check.CheckFailure as e:
            raise check.CheckFailure(f"{e} The matmul and its epilogue run in one kernel of yours: no second "
                                     "kernel, no loop of launches.") from None
    extra = ", bias + tanh GELU in the epilogue" if with_bias else ""
    check.verdict(name, f"matches the float64 reference on tile-multiple, ragged, odd and transposed shapes{extra}, "
                        "every dtype tried, one Triton launch")


def check_matmul(fn, name: str = "matmul tile loop", *, dtypes=None, hint: str = "") -> None:
    """Raise :class:`check.CheckFailure` unless ``fn(a, b)`` computes ``a @ b``; print the verdict."""
    _check(fn, name, False, dtypes, hint)


def check_linear_gelu(fn, name: str = "fused bias + GELU epilogue", *, dtypes=None, hint: str = "") -> None:
    """Raise :class:`check.CheckFailure` unless ``fn(x, w, b)`` computes ``gelu(x @ w + b)`` (tanh form)."""
    _check(fn, name, True, dtypes, hint)
