"""Checkers of chapter 2 (fusion accounting): counting bytes by hand, and the time model.

Each check calls the student's function on fresh random sizes (odd ones, past 2**31 elements, a
single element, every common element size), compares with :mod:`course_utils.traffic`, and on a
mismatch says which of the usual mistakes the answer looks like (a forgotten write, elements
instead of bytes, a bias counted as a full tensor, a sum where the roofline takes a max...).
Verdicts are the same on CPU and GPU: they depend on no device.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Callable

from .. import traffic as T
from ..check import CheckFailure, refuse_answer_key, verdict

ITEMSIZES = {1: "int8", 2: "bfloat16", 4: "float32", 8: "float64"}


def _answers() -> dict:
    """The course's calculators: what the checks compare with, so a student's code may not call them."""
    found = {f"calculator traffic.{n}": getattr(T, n) for n in
             ("elementwise_chain", "softmax", "bias_gelu_dropout", "estimate_time", "speedup", "gelu_eager",
              "layernorm", "gemm_epilogue", "attention") if hasattr(T, n)}
    found["reference checkers.traffic.reference_speedup"] = reference_speedup
    found["reference checkers.traffic._ref_kernel_time_us"] = _ref_kernel_time_us
    return found


def _rng() -> random.Random:
    return random.Random(int.from_bytes(os.urandom(8), "little"))


def _call(what: str, fn: Callable, *args):
    try:
        return fn(*args)
    except NotImplementedError:
        raise
    except CheckFailure:
        raise
    except Exception as e:  # the student's code crashed: say with what
        raise CheckFailure(f"{what}: your function raised {type(e).__name__}: {e} "
                           f"(called with {', '.join(map(repr, args))})") from e


def _pair(what: str, got, args) -> tuple[int, int]:
    if not (isinstance(got, tuple) and len(got) == 2):
        raise CheckFailure(f"{what}{args}: return a tuple (unfused_bytes, fused_bytes), got {got!r}")
    for g in got:
        if isinstance(g, bool) or not isinstance(g, (int, float)) or (isinstance(g, float) and not g.is_integer()):
            raise CheckFailure(f"{what}{args}: byte counts are whole numbers, got {got!r}")
    return int(got[0]), int(got[1])


def _diagnose(got: int, expected: int, mistakes: dict[str, int]) -> str:
    for hint, wrong in mistakes.items():
        if got == wrong and wrong != expected:
            return hint
    return ""


def _mismatch(what, args, side, got, expected, mistakes):
    hint = _diagnose(got, expected, mistakes)
    msg = f"{what}{args}: {side} bytes: got {got:,}, expected {expected:,}."
    if hint:
        msg += f"\nHint: {hint}"
    raise CheckFailure(msg)


def _fixed_itemsize(count: Callable[[int], int], itemsize: int) -> dict[str, int]:
    """The count with another dtype's element size hard-coded, and in bits instead of bytes."""
    found = {f"that count uses {b} bytes per element ({ITEMSIZES[b]}) whatever the call asks: multiply by the "
             f"itemsize argument ({itemsize} here)": count(b) for b in (4, 2) if b != itemsize}
    found["that is bits: the question is bytes (multiply by itemsize, not by 8 * itemsize)"] = count(8 * itemsize)
    return found


def _sizes(rng: random.Random) -> list[int]:
    return [1, 7, 1000, rng.randrange(10**5, 10**6) | 1, 2**31 + rng.randrange(1, 1000)]


def check_chain_bytes(fn: Callable) -> None:
    """``fn(n_ops, numel, itemsize) -> (unfused_bytes, fused_bytes)`` for a chain of unary ops."""
    refuse_answer_key("chain_bytes", fn, _answers())
    rng = _rng()
    what = "chain_bytes"
    cases = [(3, 1000, 4), (5, 16384, 2), (1, 1, 2)] + [(rng.randrange(1, 17), n, rng.choice(list(ITEMSIZES)))
                                          for n in _sizes(rng)]
    for args in cases:
        n_ops, numel, itemsize = args
        c = T.elementwise_chain(n_ops, numel, ITEMSIZES[itemsize])
        got = _pair(what, _call(what, fn, *args), args)
        unfused, fused = c.unfused.total_bytes, c.fused.total_bytes
        if got[0] != unfused:
            _mismatch(what, args, "unfused", got[0], unfused, {
                "each op also writes its output: count a read AND a write per op": n_ops * numel * itemsize,
                "multiply by itemsize: the question is bytes, not elements": 2 * n_ops * numel,
                "a chain of n ops launches n kernels, each reading one tensor and writing one":
                    2 * (n_ops + 1) * numel * itemsize,
                "that is the fused count: unfused, every op reads and writes the whole tensor": fused,
                **_fixed_itemsize(lambda b: 2 * n_ops * numel * b, itemsize)})
        if got[1] != fused:
            _mismatch(what, args, "fused", got[1], fused, {
                "the fused kernel still writes its result once: one read and one write": numel * itemsize,
                "multiply by itemsize: the question is bytes, not elements": 2 * numel,
                "fused means the intermediates never reach HBM: x is read once and y written once, "
                "whatever the chain length": unfused, **_fixed_itemsize(lambda b: 2 * numel * b, itemsize)})
    verdict(what, f"matches the calculator on {len(cases)} chains (1 to 16 ops, 1 to over 2**31 elements)")


def check_softmax_bytes(fn: Callable) -> None:
    """``fn(rows, cols, itemsize) -> (unfused_bytes, fused_bytes)`` under the 5-op convention."""
    refuse_answer_key("softmax_bytes", fn, _answers())
    rng = _rng()
    what = "softmax_bytes"
    cases = [(4, 6, 4), (4096, 4096, 2), (1, 1, 4)] + [
        (rng.randrange(1, 5000), rng.randrange(1, 70000) | 1, rng.choice([2, 4])) for _ in range(4)]
    for args in cases:
        m, n, b = args
        c = T.softmax(m, n, ITEMSIZES[b])
        got = _pair(what, _call(what, fn, *args), args)
        unfused, fused = c.unfused.total_bytes, c.fused.total_bytes
        if got[0] != unfused:
            _mismatch(what, args, "unfused", got[0], unfused, {
                "8MN + 4M counts elements: multiply by itemsize": 8 * m * n + 4 * m,
                "count the row vectors too: amax and sum each write M values, sub and div each read M":
                    8 * m * n * b,
                "five ops, five kernels: amax and sum read MN and write only M, they do not write MN":
                    10 * m * n * b,
                "that is the fused count": fused,
                "sub and div read the row vectors back: 4M, not 2M (amax and sum write M each, sub and div "
                "read M each)": (8 * m * n + 2 * m) * b,
                "the row vectors hold one value per row (M = rows), not one per column": (8 * m * n + 4 * n) * b,
                "under the 5-op convention the row vectors have x's dtype: 4M * itemsize, not 4M float32 values":
                    8 * m * n * b + 16 * m,
                **_fixed_itemsize(lambda s: (8 * m * n + 4 * m) * s, b)})
        if got[1] != fused:
            _mismatch(what, args, "fused", got[1], fused, {
                "multiply by itemsize": 2 * m * n,
                "the fused kernel reads the row once AND writes the result once": m * n * b,
                "the fused kernel keeps each row on chip between its passes: it reads x once and writes y "
                "once, 2MN (a second read of the row from HBM is not counted)": 3 * m * n * b,
                "the fused kernel keeps each row on chip between its passes (max, sum, normalize): one read "
                "and one write, 2MN": 4 * m * n * b,
                **_fixed_itemsize(lambda s: 2 * m * n * s, b)})
    verdict(what, f"matches the 5-op convention on {len(cases)} shapes")


def check_bias_gelu_dropout_bytes(fn: Callable) -> None:
    """``fn(rows, cols, itemsize) -> (unfused, fused)`` for dropout(gelu(x + bias)), bias per
    column: eager dropout (``native_dropout``, training) writes a 1-byte keep-mask per element
    besides its output; the fused kernel regenerates the mask from the seed and writes none."""
    refuse_answer_key("bias_gelu_dropout_bytes", fn, _answers())
    rng = _rng()
    what = "bias_gelu_dropout_bytes"
    cases = [(37, 129, 4), (1024, 4096, 2), (1, 1, 2)] + [
        (rng.randrange(1, 3000), rng.randrange(1, 20000) | 1, rng.choice([2, 4])) for _ in range(4)]
    for args in cases:
        m, n, b = args
        unfused = T.bias_gelu_dropout(m, n, ITEMSIZES[b], mask="saved").unfused.total_bytes
        fused = T.bias_gelu_dropout(m, n, ITEMSIZES[b], mask="generated").fused.total_bytes
        got = _pair(what, _call(what, fn, *args), args)
        mn = m * n
        if got[0] != unfused:
            _mismatch(what, args, "unfused", got[0], unfused, {
                "the bias is one value per column (cols values), not a full rows x cols tensor":
                    14 * mn * b // 2 + mn,
                "eager dropout (native_dropout) also writes a keep-mask, one byte per element, that autograd "
                "saves for the backward pass": 6 * mn * b + n * b,
                "the mask is torch.bool: one byte per element, whatever the itemsize of x": (7 * mn + n) * b,
                "the first kernel reads the bias too (cols values)": 6 * mn * b + mn,
                "multiply the tensors' elements by itemsize (the mask's by 1)": 7 * mn + n,
                "the bias is one value per column: cols values, not rows": 6 * mn * b + m * b + mn,
                "torch.bool takes one byte per element, not one bit: the mask is rows * cols bytes":
                    6 * mn * b + n * b + mn // 8,
                "the forward writes the mask once and does not read it back (the backward does)":
                    6 * mn * b + n * b + 2 * mn,
                **_fixed_itemsize(lambda s: (6 * mn + n) * s + mn, b)})
        if got[1] != fused:
            _mismatch(what, args, "fused", got[1], fused, {
                "the fused kernel regenerates the mask from the seed and the element's index: it writes "
                "no mask": (2 * mn + n) * b + mn,
                "the bias is one value per column (cols values), not a full rows x cols tensor": 3 * mn * b,
                "the fused kernel reads the bias once (cols values)": 2 * mn * b,
                "multiply by itemsize": 2 * mn + n,
                "the bias is one value per column: cols values, not rows": (2 * mn + m) * b,
                **_fixed_itemsize(lambda s: (2 * mn + n) * s, b)})
    verdict(what, f"matches the calculator on {len(cases)} shapes (bias per column; eager saves a 1-byte "
                  "mask, fused regenerates it)")


def _ref_kernel_time_us(nbytes, flops, hbm_gbps, peak_tflops, launch_us):
    k = T.Kernel("k", nbytes, 0, flops)
    t = T.Traffic("t", (k,))
    return T.estimate_time(t, None, hbm_gbps=hbm_gbps, peak_tflops=peak_tflops, l2_bytes=0,
                           launch_us=launch_us, l2_reuse=False).us


def check_kernel_time(fn: Callable) -> None:
    """``fn(nbytes, flops, hbm_gbps, peak_tflops, launch_us) -> microseconds`` of one kernel."""
    refuse_answer_key("kernel_time_us", fn, _answers())
    rng = _rng()
    what = "kernel_time_us"
    # fixed cases first: memory-bound, compute-bound, empty, and one where both times are of one size
    # (1000 us and 500 us), so that a sum or a min differs from the max whatever the random cases draw
    cases = [(2 * 10**9, 0, 2000, 100, 10), (1000, 10**12, 1000, 100, 0), (0, 0, 3350, 989, 10),
             (10**9, 5 * 10**10, 1000, 100, 5)]
    for _ in range(6):
        cases.append((rng.randrange(1, 10**10), rng.choice([0, rng.randrange(1, 10**13)]),
                      rng.choice([320, 2039, 3350, 4800]), rng.choice([65, 312, 989]), rng.choice([0, 5, 10])))
    failed = []   # (args, got, expected, the hints whose mistake gives got)
    for args in cases:
        nbytes, flops, bw, peak, launch = args
        got = _call(what, fn, *args)
        if isinstance(got, bool) or not isinstance(got, (int, float)) or not math.isfinite(got):
            raise CheckFailure(f"{what}{args}: return a number of microseconds, got {got!r}")
        expected = _ref_kernel_time_us(*args)
        if math.isclose(got, expected, rel_tol=1e-6, abs_tol=1e-9):
            continue
        mem, comp = nbytes / (bw * 1e9) * 1e6, flops / (peak * 1e12) * 1e6
        hints = _matching(got, {
            "memory and compute overlap: take max(bytes / bandwidth, flops / peak), not their sum":
                mem + comp + launch,
            "add the launch overhead (launch_us) once per kernel": max(mem, comp),
            "GB/s means 1e9 bytes per second and TFLOP/s 1e12 FLOP per second": max(nbytes / bw, flops / peak)
                + launch,
            "return microseconds, not seconds": (max(mem, comp) + launch) * 1e-6,
            "the roofline takes the larger of the two times (the slower resource limits)": min(mem, comp) + launch,
            "return microseconds, not milliseconds": (max(mem, comp) + launch) * 1e-3,
            "return microseconds, not nanoseconds": (max(mem, comp) + launch) * 1e3,
            "GB/s means 1e9 bytes per second, not 2**30": max(nbytes / (bw * 2**30) * 1e6, comp) + launch,
            "TFLOP/s means 1e12 FLOP per second, not 1e9": max(mem, flops / (peak * 1e9) * 1e6) + launch,
            "launch_us is already in microseconds: add it as it is": max(mem, comp) + launch * 1e-3,
            "nbytes already counts every read and write: divide it by the bandwidth once, do not double it":
                max(2 * mem, comp) + launch,
        })
        if got == round(expected):
            hints.append("that is the time rounded to a whole microsecond: return it unrounded")
        failed.append((args, got, expected, hints))
    if failed:
        # On one kernel two mistakes can give the same number (a compute-bound kernel read in nanoseconds, or with
        # TFLOP/s taken as 1e9 FLOP/s): name the mistake that explains every kernel the answer got wrong.
        args, got, expected, hints = failed[0]
        common = [h for h in hints if all(h in f[3] for f in failed)]
        raise CheckFailure(f"{what}{args}: got {got:.6g} us, expected {expected:.6g} us."
                           + (f"\nHint: {common[0]}" if common else ""))
    verdict(what, f"matches max(bytes / bandwidth, flops / peak) + launch on {len(cases)} kernels")


def _matching(got: float, mistakes: dict[str, float]) -> list[str]:
    """The hints whose wrong value is ``got``, in the order given."""
    return [hint for hint, wrong in mistakes.items() if math.isclose(got, wrong, rel_tol=1e-6, abs_tol=1e-12)]


#: The fusions a student judges in exercise 2.5: name -> comparison.
def candidate_fusions() -> dict[str, T.Comparison]:
    return {
        "GELU as 9 eager ops, 256 MiB bf16": T.gelu_eager(128 * 2**20, "bf16"),
        "softmax 4096 x 4096 fp32": T.softmax(4096, 4096, "fp32"),
        "LayerNorm 8192 x 4096 bf16": T.layernorm(8192, 4096, "bf16"),
        "bias + GELU epilogue of an 8192^3 GEMM, bf16": T.gemm_epilogue(8192, 8192, 8192, dtype="bf16"),
        "bias + GELU epilogue of a 16 x 4096 x 4096 GEMM (decode), bf16":
            T.gemm_epilogue(16, 4096, 4096, dtype="bf16"),
        "attention B=4 H=16 N=4096 d=128 bf16": T.attention(4, 16, 4096, 128, "bf16"),
    }


def reference_speedup(comparison: T.Comparison, gpu: str, dtype: str = "bfloat16") -> float:
    """Exercise 2.5's answer: the time model without L2 reuse, launches added."""
    return T.speedup(comparison, gpu, dtype, l2_reuse=False)["estimated_speedup"]


def _model_speedup(comp: T.Comparison, gpu: str, dtype: str, *, launch: bool = True, peak_dtype: str | None = None,
                   reads_only: bool = False, add: bool = False, merged: bool = False,
                   one_launch: bool = False, flops: bool = True) -> float:
    """Exercise 2.5's speedup computed with one of the usual mistakes (see SPEEDUP_FAULTS)."""
    from .. import hardware
    spec = hardware.lookup(gpu)
    peak, lat = spec.peak_tflops(peak_dtype or dtype), T.LAUNCH_OVERHEAD_US if launch else 0.0

    def one(nbytes, flops):
        mem, compute = nbytes / (spec.hbm_gbps * 1e9) * 1e6, flops / (peak * 1e12) * 1e6
        return (mem + compute if add else max(mem, compute)) + (0.0 if one_launch else lat)

    def total(t):
        ks = [(k.read_bytes if reads_only else k.total_bytes, k.flops if flops else 0) for k in t.kernels]
        return (one(sum(b for b, _ in ks), sum(f for _, f in ks)) if merged else sum(one(b, f) for b, f in ks)) \
            + (lat if one_launch else 0.0)
    return total(comp.unfused) / total(comp.fused)


#: Exercise 2.5's usual mistakes: hint -> the options of _model_speedup that make it.
SPEEDUP_FAULTS = {
    "add each kernel's launch overhead (T.LAUNCH_OVERHEAD_US) to its time: launches are what make many "
    "small kernels slow": {"launch": False},
    "use the peak of the dtype you were given, spec.peak_tflops(dtype), not float32's": {"peak_dtype": "float32"},
    "a kernel's traffic is its reads and its writes: k.total_bytes, not k.read_bytes": {"reads_only": True},
    "memory and compute overlap inside each kernel: take their max, not their sum (use your kernel_time_us)":
        {"add": True},
    "time each kernel on its own and sum the times: every kernel pays its own launch and its own roofline; one "
    "time for all the bytes and FLOPs together is a single kernel's": {"merged": True},
    "every kernel pays its own launch: add T.LAUNCH_OVERHEAD_US once per kernel, not once per version":
        {"one_launch": True},
    "a kernel's FLOPs count too: its time is the larger of bytes / bandwidth and flops / peak (pass k.flops to "
    "your kernel_time_us, not 0); with the bytes alone a compute-bound kernel, a GEMM or attention's matmuls, "
    "looks memory-bound and far too fast": {"flops": False},
}


def check_fusion_speedup(fn: Callable) -> None:
    """``fn(comparison, gpu, dtype) -> estimated speedup`` with the student's time model, on every
    candidate fusion, on an H100 (bf16) and on a T4 (fp16: it has no bf16)."""
    refuse_answer_key("fusion_speedup", fn, _answers())
    what = "fusion_speedup"
    n = 0
    failed = []   # (name, gpu, got, expected, the hints whose mistake gives got)
    for gpu, dtype in (("h100-sxm", "bfloat16"), ("t4", "float16")):
        for name, comp in candidate_fusions().items():
            got = _call(what, fn, comp, gpu, dtype)
            if isinstance(got, bool) or not isinstance(got, (int, float)) or not math.isfinite(got):
                raise CheckFailure(f"{what}({name!r}, {gpu!r}): return the speedup as a number, got {got!r}")
            expected = reference_speedup(comp, gpu, dtype)
            n += 1
            if math.isclose(got, expected, rel_tol=1e-3):
                continue
            hints = [h for h, wrong in (
                ("that is the traffic ratio alone: time each kernel with your kernel_time_us (flops and launches "
                 "count too) and divide the sums", comp.ratio),
                ("speedup = unfused time / fused time, not the other way round", 1 / expected),
                *((h, _model_speedup(comp, gpu, dtype, **kw)) for h, kw in SPEEDUP_FAULTS.items()),
            ) if math.isclose(got, wrong, rel_tol=1e-3)]
            failed.append((name, gpu, got, expected, hints))
    if failed:
        # On a memory-bound fusion without launches the speedup is the traffic ratio: several mistakes can give
        # one number. Name the mistake that explains every fusion the answer got wrong.
        name, gpu, got, expected, hints = failed[0]
        common = [h for h in hints if all(h in f[4] for f in failed)]
        raise CheckFailure(f"{what}({name!r}, {gpu!r}): got {got:.4g}, expected {expected:.4g}."
                           + (f"\nHint: {common[0]}" if common else ""))
    verdict(what, f"matches the time model on {n} fusion(s) on two GPUs")
