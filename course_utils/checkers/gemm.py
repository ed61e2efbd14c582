"""Checks for chapter 9 (a matmul and its fused epilogues).
(The operands in guard zones, the load checks and the calls are in :mod:`.gemm_operands`; the fault catalogue is
``faults.gemm``.)

:func:`check_matmul` judges ``fn(a, b) -> a @ b``, :func:`check_linear_gelu` ``fn(x, w, b) ->
gelu(x @ w + b)`` (tanh GELU, bias per output column) and :func:`check_linear_gelu_residual`
``fn(x, w, b, r) -> gelu(x @ w + b) + r`` (``r`` a strided M x N view). Every call draws fresh signed
inputs; the cases go from sizes that are multiples of any tile to ragged M and N, a ragged K, odd
sizes down to 1 and transposed operands (a view with stride 1 along its first dimension); the epilogue
checks add an accumulator that every precision computes exactly, with ``acc + bias`` spread where the tanh
and erf forms of GELU differ by up to 4.7e-4 (far above that case's float32 tolerance); in float16 and
bfloat16 that case's output must be float32 math rounded once, at the store (an epilogue that rounds
``acc + bias`` or GELU's output to 16 bits on the way stays inside the dtype's tolerance, not inside that).

Inputs sit inside guard zones filled with NaN: a load past the end of an operand brings a NaN into the
sum, so a K mask missing on one operand fails on a GPU as well, every time. Under the interpreter every
load is recorded (:func:`check.track_loads`), and a load outside the operands (rows past M, columns past
N or K, the bias past N) fails, named by operand. The function must launch exactly one Triton kernel
of its own, and neither it nor the kernels it calls may use the course's answer (``tile_matmul``, the
launchers, ``torch.mm``/``F.linear``/``addmm``): :func:`refuse_course_answers`. When a case fails the
checker tries the usual faults against the output and names the one that fits.

A load mask missing in 9.2's epilogue changes nothing the launcher stores (its store masks those lanes),
so given the epilogue function the residual check also calls it in a kernel of its own
(:func:`check_epilogue_masks`) on a tile that overhangs M and N and stores every lane: a lane past M or N
that loaded from the NaN guard zone shows, on a GPU as under the interpreter. For 9.1's split-K slice,
where a loop over the whole K range with a mask `k >= k_start` gives the right numbers, the loads show
it (interpreter): a load with every lane masked off is a K tile outside the slice, and an operand whose
elements in the earlier slices' K range are read more often than the last slice's was loaded there for
real and zeroed (the mask on one operand only, or a tl.where).
"""

from __future__ import annotations

import inspect

import numpy as np
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .. import check, env
from ..faults.gemm import EXACT, diagnose, gelu_tanh, slice_faults
from .gemm_operands import Operand, call, require_loads_inside, require_slice_walked
from .loads import LOADS_SEEN

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


#: float32 only: operands in {-0.5, 0, 0.5} make every product and partial sum exact in tf32, float16
#: and float32, so the tolerance can be far below the 4.7e-4 between the tanh and erf forms of GELU
EXACT_TOL = (2e-5, 2e-5)
#: the same exact accumulator in float16 and bfloat16: the epilogue in float32, rounded once at the store, is within
#: half a unit in the last place of the float64 answer, plus float32's error, this much of |acc + bias| + |r|
F32_EPILOGUE = 2e-5


def _rounded_once(case: str, got, expected, terms, dtype) -> None:
    """A 16-bit output of the exact-accumulator case must be float32 math rounded once, at the store: within half a
    unit in its last place of the float64 answer (and half a float16 subnormal step), plus F32_EPILOGUE of its terms.
    The dtype's tolerance lets through an epilogue that rounds on the way (acc + bias, or GELU's output before the
    residual is added): one more rounding, up to half a unit of a term, which a residual that cancels GELU's output
    leaves far larger than half a unit of the result."""
    if dtype not in (torch.float16, torch.bfloat16):
        return
    unit = 2.0**-11 if dtype == torch.float16 else 2.0**-8
    g = got.detach().to("cpu", torch.float64)
    bad = (g - expected).abs() > unit * expected.abs() + 2.0**-25 + F32_EPILOGUE * terms
    if bool(bad.any()):
        i, j = (int(v) for v in bad.nonzero()[0])
        name = _name(dtype)
        raise check.CheckFailure(
            f"{case}: {int(bad.sum())} element(s) of the output are further from the float64 answer than float32 math "
            f"rounded once to {name} (first at ({i}, {j}): got {float(g[i, j]):.6g}, expected "
            f"{float(expected[i, j]):.6g}): part of the epilogue ran in {name} (acc + bias rounded to {name} before "
            "GELU, or GELU's output rounded before the residual is added, say). Keep the epilogue in float32 "
            "(.to(tl.float32) right after each tl.load, no cast on the way) and round once, at the store.")


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _operands(m, n, k, dtype, transposed, cancelling=False, exact=False):
    gen = check.generator()
    a = check.randn((m, k), torch.float32, gen=gen)
    b = check.randn((k, n), torch.float32, gen=gen)
    if cancelling:
        # every product is about +256 over the first half of K and -256 over the second: the running
        # sum climbs past float16's largest value (65504) and comes back to a small result
        a = 16.0 + 0.25 * a
        b = torch.cat([16.0 + 0.25 * b[: k // 2], -16.0 + 0.25 * b[k // 2:]])
    if exact:
        a, b = 0.5 * torch.sign(a.round()), 0.5 * torch.sign(b.round())
    a, b = a.to(dtype), b.to(dtype)
    if transposed:  # the same values, stored column by column
        a, b = a.T.contiguous().T, b.T.contiguous().T
    return a, b


def _close(got, expected, atol, rtol) -> bool:
    g = got.detach().to("cpu", torch.float64)
    return bool(torch.isclose(g, expected.cpu(), atol=atol, rtol=rtol).all())


def _answers(epilogue: str) -> dict:
    """The course's answers for a chapter 9 exercise: ``{description: object}``."""
    from ..kernels import gemm as G
    from ..tuned import gemm as T
    found = {"teaching launcher (matmul_teaching)": G.matmul_teaching,
             "teaching launcher (linear_gelu_teaching)": G.linear_gelu_teaching,
             "teaching kernel (matmul_kernel)": G.matmul_kernel, "epilogue (kernels.gemm.epilogue)": G.epilogue,
             "reference (matmul_ref)": G.matmul_ref, "reference (linear_gelu_ref)": G.linear_gelu_ref,
             "tuned matmul (tuned.gemm.matmul)": T.matmul, "tuned linear_gelu": T.linear_gelu,
             "torch.mm (cuBLAS)": torch.mm, "torch.matmul": torch.matmul, "torch.addmm": torch.addmm,
             "F.linear": F.linear, "torch._addmm_activation": getattr(torch, "_addmm_activation", None),
             "F.gelu": F.gelu}
    if epilogue == "none":   # exercise 9.1 is the K loop: the lecture's tile_matmul is its answer
        found["K loop (kernels.gemm.tile_matmul)"] = G.tile_matmul
    for name, obj in list(found.items()):
        if hasattr(obj, "fn"):   # a @triton.jit kernel: its Python function too
            found[name + " "] = obj.fn
    return {k: v for k, v in found.items() if v is not None}


def _own_code(fn) -> list:
    """``fn`` and every function or @triton.jit kernel of the student's that it reaches (not the course's)."""
    todo, seen, out = [fn], set(), []
    while todo:
        item = todo.pop()
        f = getattr(item, "fn", item)
        if id(f) in seen or not inspect.isfunction(f):
            continue
        seen.add(id(f))
        out.append(f)
        for _, obj in check._referenced(f):
            inner = getattr(obj, "fn", obj)
            theirs = not (getattr(inner, "__module__", "") or "").startswith(("course_utils", "torch", "triton"))
            if inspect.isfunction(inner) and theirs:
                todo.append(obj)
    return out


def refuse_course_answers(name: str, fn, epilogue: str = "none") -> None:
    """Raise if ``fn``, or a function or kernel of the student's that it calls, uses the course's answer."""
    forbidden = _answers(epilogue)
    for f in _own_code(fn):
        check.refuse_answer_key(name, f, forbidden)


def _check(fn, name: str, epilogue: str, dtypes, hint: str, k_slices: int = 1, probe=None) -> None:
    refuse_course_answers(name, fn, epilogue)
    with_bias, with_res = epilogue != "none", epilogue == "gelu_residual"
    dtypes = tuple(dtypes or env.supported_dtypes())
    for dtype in dtypes:
        per_sqrt_k = GEMM_TOLERANCES[dtype][0]
        todo = list(cases())
        if dtype == torch.float16:
            # first: a float16 accumulator overflows here every time, while the random cases before it would
            # pass or fail it by luck (a sum that lost precision), naming the same fault two ways
            k = 640 if env.on_gpu() else 576
            todo.insert(0, ("cancelling sums that pass 65504 in the middle of the K loop", 16, 32, k, False))
        if with_bias:   # float32: the GELU form, last; 16-bit dtypes: the epilogue rounded once (_rounded_once), early
            exact = (EXACT, 19, 37, 24, False)
            todo.append(exact) if dtype == torch.float32 else todo.insert(1, exact)
        passed = 0
        for what, m, n, k, transposed in todo:
            case = f"{name} ({_name(dtype)}, M={m}, N={n}, K={k}, {what})"
            a, b = _operands(m, n, k, dtype, transposed, cancelling="cancelling" in what, exact=what == EXACT)
            ops = [Operand("a", a), Operand("b", b)]
            if with_bias:
                scale = 1.5 if what == EXACT else 1.0
                ops.append(Operand("bias", check.randn((n,), dtype, scale=scale)))
            if with_res:   # the first N columns of an M x (N + 3) tensor: its row stride is not N
                ops.append(Operand("residual", check.randn((m, n), dtype), pad_cols=3))
            originals = [o.view.clone() for o in ops]
            with check.track_loads() as loads:
                got = call(fn, [o.view for o in ops], case)
            if not isinstance(got, torch.Tensor) or tuple(got.shape) != (m, n):
                raise check.CheckFailure(f"{case}: expected a {m} x {n} tensor, got "
                                         f"{tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}")
            for o, t in zip(ops, originals):
                o.unchanged(case, t)
            try:
                require_loads_inside(case, loads, ops, what)
            except check.CheckFailure as e:
                raise check.CheckFailure(_k_stop(str(e), k_slices)) from None
            acc = a.double() @ b.double()
            bias = ops[2].view.double().cpu() if with_bias else None
            res = ops[3].view.double().cpu() if with_res else None
            res_flat = None
            if with_res:   # what r_ptr + m * N + n reads (the row stride ignored)
                inner = ops[3].buffer[ops[3].guard:]
                res_flat = inner[: m * n].view(m, n).double().cpu()
            expected = acc if bias is None else gelu_tanh(acc.cpu() + bias) + (0.0 if res is None else res)
            atol = per_sqrt_k * (k ** 0.5) * (16 if "cancelling" in what else 1)
            exact32 = what == EXACT and dtype == torch.float32
            atol, rtol = EXACT_TOL if exact32 else (atol, GEMM_TOLERANCES[dtype][1])
            if not _close(got, expected, atol, rtol):
                extra = slice_faults(a, b, k_slices) if epilogue == "none" else ()
                fault = _k_stop(diagnose(got, acc, bias, res, res_flat, atol, rtol, what, passed > 0, extra), k_slices)
                check.compare(case, got, expected, dtype=dtype, atol=atol, rtol=rtol, hint=fault or hint)
            if what == EXACT:
                terms = (acc.cpu() + bias).abs() + (0.0 if res is None else res.abs())
                _rounded_once(case, got, expected, terms, dtype)
            require_slice_walked(case, loads, k_slices, ops)
            passed += 1
    # one Triton kernel: the product and its epilogue in a single launch (torch.empty for the output is fine)
    dtype = dtypes[0]
    a, b = _operands(33, 40, 48, dtype, False)
    args = [a, b] + [check.randn((40,), dtype)] * with_bias + [check.randn((33, 40), dtype)] * with_res
    with np.errstate(over="ignore"):
        try:
            check.check_kernel_launches(name, fn, *args, expected=1)
        except check.CheckFailure as e:
            raise check.CheckFailure(f"{e} The matmul and its epilogue run in one kernel of yours: no second "
                                     "kernel, no loop of launches.") from None
    if probe is not None:
        check_epilogue_masks(name, probe)
    extra = {"none": "", "gelu": ", bias + tanh GELU in the epilogue",
             "gelu_residual": ", bias + tanh GELU + a strided residual in the epilogue"}[epilogue]
    check.verdict(name, f"matches the float64 reference on tile-multiple, ragged, odd and transposed shapes{extra}, "
                        "every dtype tried, no load outside the operands " + LOADS_SEEN + ", one Triton launch")


@triton.jit
def _epilogue_probe_kernel(acc_ptr, bias_ptr, r_ptr, out_ptr, M, N, stride_rm, EPILOGUE: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One tile of 9.2's epilogue, offsets as the exercise's kernel makes them, every lane stored."""
    offs_m = tl.arange(0, BLOCK_M).to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N).to(tl.int64)
    tile = offs_m[:, None] * BLOCK_N + offs_n[None, :]
    acc = tl.load(acc_ptr + tile)
    y = EPILOGUE(acc, bias_ptr, r_ptr, offs_m, offs_n, M, N, stride_rm)
    tl.store(out_ptr + tile, y.to(tl.float32))


#: the probe's tile and the ragged M x N inside it (the residual a view with 3 columns of padding)
PROBE_TILE, PROBE_M, PROBE_N, PROBE_PAD = 16, 5, 11, 3


def check_epilogue_masks(name: str, epilogue) -> None:
    """Raise unless 9.2's ``epilogue(acc, bias_ptr, r_ptr, offs_m, offs_n, M, N, stride_rm)`` masks its loads.

    The launcher's store drops the lanes past M and N, so a load left unmasked there changes nothing it
    stores, and a GPU records no loads. Here a kernel of the check's calls the epilogue on a 16 x 16 tile over
    a 5 x 11 residual and bias inside NaN guard zones and stores every lane: each lane of the rows past M
    (or of the columns past N) is NaN only if that lane loaded from the guard zone."""
    t, m, n = PROBE_TILE, PROBE_M, PROBE_N
    bias = Operand("bias", check.randn((n,), torch.float32))
    res = Operand("residual", check.randn((m, n), torch.float32), pad_cols=PROBE_PAD)
    acc = check.randn((t, t), torch.float32)
    out = torch.zeros((t, t), dtype=torch.float32, device=acc.device)
    case = f"{name} (your epilogue alone, on a {t} x {t} tile over M={m}, N={n}; every lane stored)"
    call(lambda: _epilogue_probe_kernel[(1,)](acc, bias.view, res.view, out, m, n, res.view.stride(0),
                                               EPILOGUE=epilogue, BLOCK_M=t, BLOCK_N=t), [], case)
    nan = torch.isnan(out.cpu())
    if bool(nan[m:, :n].all()):
        raise check.CheckFailure(f"{case}: every lane of the rows past M came out NaN, the NaN of the guard zone "
                                 "below the residual: the residual load is not masked by rows. The launcher's store "
                                 "hides it, but those lanes read past the end of r: mask the load with "
                                 "(offs_m[:, None] < M) & (offs_n[None, :] < N), other=0.0.")
    if bool(nan[:m, n:].all()):
        raise check.CheckFailure(f"{case}: every lane of the columns past N came out NaN, the NaN past the end of the "
                                 "bias: the bias load is not masked by columns. Load it with mask=offs_n < N, "
                                 "other=0.0.")
    if bool(nan[:m, n:n + PROBE_PAD].all()):
        raise check.CheckFailure(f"{case}: the lanes of the columns just past N came out NaN, the padding after each "
                                 "row of the residual view: the residual load is not masked by columns. Mask it "
                                 "with (offs_m[:, None] < M) & (offs_n[None, :] < N), other=0.0.")


def _k_stop(message: str, k_slices: int) -> str:
    """In a K slice the loop's end is k_stop, not K: say so in the K-mask hints."""
    return message.replace("k < K", "k < k_stop").replace("k <= K", "k <= k_stop") if k_slices > 1 else message


def check_matmul(fn, name: str = "matmul tile loop", *, dtypes=None, hint: str = "", k_slices: int = 1) -> None:
    """Raise :class:`check.CheckFailure` unless ``fn(a, b)`` computes ``a @ b``; print the verdict.
    ``k_slices``: the kernel sums K in that many slices of ``cdiv(K, k_slices)`` (exercise 9.1), so a
    slice summed from 0 or past its end is named."""
    _check(fn, name, "none", dtypes, hint, k_slices)


def check_linear_gelu(fn, name: str = "fused bias + GELU epilogue", *, dtypes=None, hint: str = "") -> None:
    """Raise :class:`check.CheckFailure` unless ``fn(x, w, b)`` computes ``gelu(x @ w + b)`` (tanh form)."""
    _check(fn, name, "gelu", dtypes, hint)


def check_linear_gelu_residual(fn, name: str = "bias + GELU + residual epilogue", *, dtypes=None,
                               hint: str = "", epilogue=None) -> None:
    """Raise unless ``fn(x, w, b, r)`` computes ``gelu(x @ w + b) + r`` (tanh GELU; ``r`` is an M x N view
    whose row stride is not N). ``epilogue``: the exercise's epilogue function, whose load masks are then
    judged on their own as well (:func:`check_epilogue_masks`, GPU and interpreter alike)."""
    if epilogue is not None:
        refuse_course_answers(name, epilogue, "gelu_residual")
    _check(fn, name, "gelu_residual", dtypes, hint, probe=epilogue)
