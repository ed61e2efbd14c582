"""The usual faults of chapter 9's kernel exercises, recomputed in float64 and named (used by
:mod:`course_utils.checkers.gemm`): the bias on the wrong axis or masked by M, GELU before the bias, the erf,
sigmoid or cubic-less forms, the residual's row stride ignored or its mask's M and N swapped, an accumulator
in float16, a missing K mask and, for the K loop (exercise
9.1's split-K slice), a slice summed from 0 or past its end, a slice's K indices without k_start and a last
partial K tile never summed.

Not a checker itself: nothing here takes a student's function. Every check that uses it first refuses
the course's answers (``checkers.gemm.refuse_course_answers``: the teaching and tuned kernels and
launchers, ``tile_matmul`` for exercise 9.1, the references and the torch ops) and counts launches of
the student's own kernel only; ``tests/test_gemm_checkers.py`` proves both for each exercise."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .fits import FaultFits

EXACT = "an accumulator exact in every precision, acc + bias spread over [-4, 4]"


def slice_bounds(k: int, slices: int) -> list[tuple[int, int]]:
    """The K slices ``[k_start, k_stop)`` of the exercise's kernel: ``cdiv(K, slices)`` long, the last shorter."""
    per = -(-k // slices)
    return [(s * per, min((s + 1) * per, k)) for s in range(slices) if s * per < k]


def slice_faults(a: torch.Tensor, b: torch.Tensor, slices: int) -> list[tuple[str, torch.Tensor]]:
    """(hint, what the kernel computes) for the usual mistakes in the loop over one K slice."""
    a, b = a.double().cpu(), b.double().cpu()
    k = a.shape[1]
    bounds = slice_bounds(k, slices)
    out = [("each slice starts at k_start: a loop from 0 sums the first part of K again in every later slice",
            sum(a[:, :stop] @ b[:stop] for _, stop in bounds))]
    out.append(("each slice's K indices start at k_start: a loop over range(0, k_stop - k_start, BLOCK_K) needs "
                "k = k_start + k0 + offs_k (without k_start every slice sums the first K columns again); or loop "
                "over range(k_start, k_stop, BLOCK_K) with k = k0 + offs_k",
                sum(a[:, :stop - start] @ b[:stop - start] for start, stop in bounds)))
    for block_k in (16, 32, 64, 128, 256):   # the last tile of a slice runs past k_stop, into the next slice
        ends = [min(start + math.ceil((stop - start) / block_k) * block_k, k) for start, stop in bounds]
        out.append(("a slice ends at k_stop: mask the K lanes of both loads with k < k_stop (other=0.0); the "
                    "last tile of a slice otherwise runs into the next slice, and those terms are counted twice",
                    sum(a[:, start:end] @ b[start:end] for (start, _), end in zip(bounds, ends))))
    for block_k in (16, 32, 64, 128, 256):   # whole tiles only: the partial tile at the end of a slice is missed
        ends = [start + (stop - start) // block_k * block_k for start, stop in bounds]
        if all(end == start for (start, _), end in zip(bounds, ends)):
            continue   # no whole tile at all: an output of zeros has other causes
        out.append((f"the last, partial K tile of each slice is never summed (with BLOCK_K={block_k} the terms "
                    "from the last multiple of BLOCK_K to k_stop are missing): the loop must run while k0 < k_stop, "
                    "for k0 in range(k_start, k_stop, BLOCK_K), and mask that tile's lanes with k < k_stop",
                    sum(a[:, start:end] @ b[start:end] for (start, _), end in zip(bounds, ends))))
    for block_k in (16, 32, 64, 128, 256):   # a tile count of tl.cdiv(k_stop - k_start, BLOCK_K) - 1
        ends = [start + (-(-(stop - start) // block_k) - 1) * block_k for start, stop in bounds]
        out.append((f"each slice runs one K tile too few (with BLOCK_K={block_k} its last tile, partial or whole, "
                    "is never summed): a slice has tl.cdiv(k_stop - k_start, BLOCK_K) tiles, no - 1; or loop "
                    "for k0 in range(k_start, k_stop, BLOCK_K)",
                    sum(a[:, start:end] @ b[start:end] for (start, _), end in zip(bounds, ends))))
    for name, a_sw, b_sw in (("a", _swapped(a), b), ("b", a, _swapped(b))):
        if a_sw is not None and b_sw is not None:
            right = ("a_ptr + offs_m[:, None] * stride_am + k[None, :] * stride_ak" if name == "a" else
                     "b_ptr + k[:, None] * stride_bk + offs_n[None, :] * stride_bn")
            out.append((f"{name}'s two strides are swapped (each element is read at its transpose's address, as if "
                        f"{name} were stored transposed): address it as {right}", a_sw @ b_sw))
    return out


def _swapped(t: torch.Tensor) -> torch.Tensor | None:
    """What a load that swaps the dense 2-D ``t``'s strides reads, when every address stays inside it (None
    otherwise: an address outside is a load the interpreter names, and a GPU reads the guard zone's NaN)."""
    if not (t.is_contiguous() or t.T.is_contiguous()):
        return None
    s0, s1 = t.stride()
    idx = torch.arange(t.shape[0])[:, None] * s1 + torch.arange(t.shape[1])[None, :] * s0
    if int(idx.max()) >= t.numel():
        return None
    memory = t.flatten() if t.is_contiguous() else t.T.flatten()   # the elements in the order they are stored
    return memory[idx]


def gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


def gelu_sigmoid(x):
    """The sigmoid approximation x * sigmoid(1.702 x): up to about 0.02 from the tanh form."""
    return x * torch.sigmoid(1.702 * x)


def gelu_no_cubic(x):
    """The tanh form without its cubic term: 0.5 x (1 + tanh(sqrt(2/pi) x))."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * x))


def diagnose(got, acc, bias, res, res_flat, atol, rtol, what, earlier_passed, extra=()) -> str:
    """The usual fault that explains ``got``, as a hint ('' when none fits)."""
    g = got.detach().to("cpu", torch.float64)
    acc = acc.cpu()
    r = 0.0 if res is None else res
    ref = acc if bias is None else gelu_tanh(acc + bias) + r
    faults = list(extra)
    if bias is not None:
        m = acc.shape[0]
        faults += [
            ("the bias is added along the wrong axis: it has one value per output column (N of them), so "
             "load it with the column offsets (offs_n) and broadcast it over the rows, bias[None, :]",
             gelu_tanh(acc + bias[:m, None]) + r if m <= bias.numel() else None),
            ("GELU is applied before the bias: the epilogue is gelu(acc + bias), so add the bias first",
             gelu_tanh(acc) + bias + r),
            ("the bias is missing: add it to the accumulator before GELU", gelu_tanh(acc) + r),
            ("GELU is missing: apply gelu_math(acc + bias, True) before the store", acc + bias + r),
            ("this is the exact (erf) GELU: the course's epilogue uses the tanh form, gelu_math(..., True). "
             "They differ by up to 4.7e-4 near |x| = 2.7", F.gelu(acc + bias) + r),
            ("this is the sigmoid approximation of GELU, x * sigmoid(1.702 x), up to about 0.02 from the tanh form "
             "the course's epilogue uses: gelu_math(acc + bias, True)", gelu_sigmoid(acc + bias) + r),
            ("the GELU misses its cubic term: the tanh form is 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), "
             "gelu_math(acc + bias, True)", gelu_no_cubic(acc + bias) + r),
        ]
        n = acc.shape[1]
        rows = torch.arange(m)[:, None]
        cols_n = torch.arange(n)[None, :]
        for tile in (16, 32, 64, 128, 256):   # square tiles: lane i of the row axis gets bias[offs_n[i]]
            idx = cols_n // tile * tile + rows % tile
            spread = torch.where(idx < n, bias[idx.clamp(max=n - 1)], torch.zeros((), dtype=bias.dtype))
            faults.append((f"the bias is broadcast along the wrong axis: bias[:, None] gives row i of a tile the bias "
                           f"of column offs_n[i] (it fits {tile} x {tile} tiles); it has one value per column, "
                           "bias[None, :]", gelu_tanh(acc + spread) + r))
        if m < n:   # columns >= M lose their bias (or their residual) to a mask that compares with M
            cols = torch.arange(n, dtype=torch.float64)[None, :] < m
            faults.append(("the bias load is masked with offs_n < M: the bias has N entries, one per column, so "
                           "mask it with offs_n < N", gelu_tanh(acc + bias * cols[0]) + r))
            if res is not None:
                faults.append(("the residual's mask swaps M and N: mask its load with (offs_m[:, None] < M) & "
                               "(offs_n[None, :] < N)", gelu_tanh(acc + bias) + res * cols))
        if res is not None:
            faults += [
                ("the residual is added before GELU: it is added to GELU's output, gelu(acc + bias) + r",
                 gelu_tanh(acc + bias + r)),
                ("the residual is missing: load the M x N tile of r and add it after GELU", gelu_tanh(acc + bias)),
                ("the residual's row stride is ignored: r is a view whose rows are stride_rm elements apart, "
                 "not N; address it as r_ptr + offs_m[:, None] * stride_rm + offs_n[None, :]",
                 gelu_tanh(acc + bias) + res_flat),
            ]
    fits = FaultFits(g, atol, rtol, right=ref)
    for hint, candidate in faults:
        fits.add(hint, candidate)
    if fits.best():
        return fits.best()
    finite = torch.isfinite(g)
    if not bool(finite.all()) and bool(torch.isfinite(ref).all()):
        if "cancelling" in what:
            return ("the sum overflowed: it climbs past float16's largest value (65504) in the middle of the K "
                    "loop. Accumulate in float32 (tl.zeros(..., dtype=tl.float32)) and convert once, at the store")
        if "ragged K" in what and earlier_passed:
            return ("the K mask is missing: the last K tile read past column K of a or past row K of b (the NaN "
                    "there poisons the sum, even times a masked zero). Mask both loads with k < K and other=0.0")
    scale = float(ref.abs().max()) or 1.0
    rel = float((g - ref).abs().nan_to_num(float("inf")).max()) / scale
    if rel < 0.05 and EXACT not in what:
        if bias is not None:   # a slightly different epilogue formula is as close as a sum that lost precision
            return ("close but not within tolerance: either the epilogue's formula is slightly off (it is "
                    "gelu_math(acc + bias, True), the tanh form, with the bias of column n, plus r) or the sum lost "
                    "precision (accumulate in float32 and round to the output dtype once, at the store)")
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
