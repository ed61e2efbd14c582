"""Checks for chapter 11 (the backward pass).
(Exercise 11.2's check lives in :mod:`.gelu_backward`, 11.3's in :mod:`.flash_backward`; both are re-exported here.)

- :func:`check_delta_kernel` launches a student's FlashAttention-backward preprocessing kernel
  ``kernel[(n_rows,)](o_ptr, do_ptr, delta_ptr, head_dim, o_row_stride, do_row_stride, BLOCK_D=...)``
  that writes ``delta[i] = sum_j O[i, j] * dO[i, j]`` (float32); with 16-bit O and dO each row must be within
  float32's rounding of the sum (F32_DELTA), which products rounded to 16 bits miss while float16's tolerance passes;
  a last case's rows start past 2**31 elements (``offsets64.wide_rows``), where int32 row offsets wrap.
- :func:`check_gelu_backward_kernel` launches a student's bias + GELU + dropout backward kernel
  ``kernel[grid](dy_ptr, x_ptr, bias_ptr, dx_ptr, n_elements, n_cols, p, seed, BLOCK_SIZE=...)``
  over a flat contiguous (rows x n_cols) tensor, writing ``dx = dy * gelu'(x + b) * keep / (1 - p)``
  with the keep mask of chapter 4 (``tl.rand(seed, offsets) >= p``) regenerated, not stored; z = x + b up
  to 1e30 (an unclamped z**3 overflows float32); a last case of more than 2**31 elements fails int32 offsets.
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
from .flash_backward import ATTN_CASES, attention_grads64, check_flash_backward  # noqa: F401  (re-exported)
from .gelu_backward import F32_DX, _launch, _name, check_gelu_backward_kernel  # noqa: F401  (re-exported)


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
    if dtype != torch.float32:   # products rounded to 16 bits, summed exactly: float32's sum is far closer than that
        rounded = (o * do).to("cpu", torch.float64).sum(-1)
        size = (o64 * do64).abs().sum(-1)
        near = lambda want: bool(((got - want).abs() <= F32_DELTA * size).all())  # noqa: E731
        if near(rounded) and not near(right):
            return PRODUCTS_16.format(name=_name(dtype))
    if fits(right / head_dim):
        return "delta is the row's sum divided by head_dim (a mean): D is the plain sum, tl.sum(o * do)."
    if fits((o64 * o64).sum(-1)) or fits((do64 * do64).sum(-1)):
        return "delta is rowsum(O * O) or rowsum(dO * dO): D multiplies the two tensors, rowsum(dO * O)."
    if dtype != torch.float32 and int(got.ne(0).sum()) >= 16 and torch.equal(got.to(dtype).double(), got):
        return ("delta is computed in 16 bits: every value is a 16-bit number (a float32 sum lands on one about 1 "
                "time in 2^13), off by the 16-bit rounding of the products and of the running sum. Convert O and dO "
                "with .to(tl.float32) before multiplying.")
    return ""


#: float32's error in a right delta, relative to its row's sum of |O * dO|: the products of 16-bit numbers are exact in
#: float32 and tl.sum adds them in a tree, log2(head_dim) roundings of at most 6e-8 each (under 5e-7 up to 256); a
#: product rounded to 16 bits is off by up to 2.4e-4 (float16) of itself, a row's sum of them by far more than this
F32_DELTA = 2e-6
PRODUCTS_16 = ("the products O * dO (or their sum) were computed in 16 bits, rounded to {name}: a product of two "
               "16-bit numbers is exact in float32, not in {name}. Convert O and dO with .to(tl.float32) before "
               "multiplying, then tl.sum the float32 products.")


def _check_delta_rounding(case: str, delta, o, do) -> None:
    """16-bit O and dO: each row of delta within F32_DELTA of its sum of |O * dO| (float32 products, exact); the
    dtype's tolerance lets products rounded to 16 bits through on most rows."""
    if o.dtype == torch.float32:
        return
    p = o.to("cpu", torch.float64) * do.to("cpu", torch.float64)
    err = (delta.to("cpu", torch.float64) - p.sum(-1)).abs()
    bad = err > F32_DELTA * p.abs().sum(-1) + 1e-30
    if bool(bad.any()):
        raise check.CheckFailure(f"{case}: {int(bad.sum())} row(s) of delta are further from the float64 sum than "
                                 "float32 products and a float32 sum can be (more than "
                                 f"{F32_DELTA:g} of the row's sum of |O * dO|): "
                                 + PRODUCTS_16.format(name=_name(o.dtype)))


def _delta_past_2_31(kernel, name: str, signature: str) -> None:
    """float16 O and dO whose last row starts past 2**31 elements (``offsets64.wide_rows``): pid * o_row_stride in
    int32 wraps there, and the kernel sums the padding instead."""
    from .offsets64 import HINT, wide_case, wide_launch, wide_rows
    head_dim = 80
    case = wide_case(name, head_dim)
    o_small, do_small = (check.randn((3, head_dim), torch.float16, scale=2.0) for _ in range(2))
    delta = torch.full((3,), float("nan"), device=o_small.device)

    def run(o, do):
        o.copy_(o_small)
        do.copy_(do_small)
        wide_launch(lambda: kernel[(3,)](o, do, delta, head_dim, o.stride(0), do.stride(0),
                                         BLOCK_D=triton.next_power_of_2(head_dim)), case, signature)

    with wide_rows(head_dim, ("o", "do")) as t:
        if t is None:
            return
        run(t.pop("o"), t.pop("do"))   # the views die with run: the memory goes back as the block ends
    expected = (o_small.double() * do_small.double()).sum(-1)
    check.compare(case, delta, expected, dtype=torch.float32, atol=1e-3,
                  hint=HINT.format(what="o_row_stride (and do_row_stride)"))


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
            _check_delta_rounding(case, delta.tensor, o, do)
            og.check(f"{case}, O's buffer")
            dg.check(f"{case}, dO's buffer")
    _delta_past_2_31(kernel, name, signature)
    check.verdict(name, "matches the float64 reference on every shape and dtype tried, strided rows, "
                        "no writes outside the output")
