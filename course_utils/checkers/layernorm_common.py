"""Chapter 10's checks' shared ground: the inputs every check draws (odd rows, strided, around OFFSET, small
rows below eps), the float64 statistics, the diagnosis of a kernel's mean and rstd (which mistake they look
like), the refusal of the course's answers and a student's launch with its loads checked. The forward checks
(:mod:`.layernorm`) and the backward ones (:mod:`.layernorm_backward`) both read it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from .. import check

OFFSET = 1000.0
EPS = 1e-3      # the eps every check passes: not a default of any norm, and above the small rows' variance
SMALL = 0.01    # spread of the small rows (one in four): variance 1e-4 < EPS
F32_EPS = float(torch.finfo(torch.float32).eps)
ROWS_GPU = ((7, 13), (1, 1), (37, 1000), (5, 4097), (4, 12345))  # 7x13 first: names faults (1 col: rounding)
def answers() -> dict:
    """The course's answers a check refuses: kernels, launchers, references, and torch's own norms."""
    from ..kernels import layernorm as L
    from ..tuned import layernorm as T
    from ..tuned import layernorm_kernels as TK
    names = ("L.layer_norm_fwd_kernel L.rms_norm_fwd_kernel L.norm_bwd_dx_kernel L.norm_dw_db_kernel "
             "L.column_sum_kernel L.layer_norm_teaching L.rms_norm_teaching L.layer_norm_backward_teaching "
             "L.rms_norm_backward_teaching L.layer_norm_ref L.rms_norm_ref T.layer_norm T.rms_norm T._forward "
             "T.layer_norm_backward T.rms_norm_backward T._backward TK.norm_fwd_kernel TK.norm_bwd_kernel "
             "TK.norm_bwd_chunked_kernel F.layer_norm F.rms_norm torch.layer_norm torch.native_layer_norm")
    where = {"L": L, "T": T, "TK": TK, "F": F, "torch": torch}
    return {f"{n} (the answer key)": getattr(where[n.split(".")[0]], n.split(".")[1]) for n in names.split()}


def refuse(what: str, fn) -> None:
    """Refuse the course's answers handed in as ``fn``, or called from it (a kernel's body included)."""
    for f in (fn, getattr(fn, "fn", None)):  # a @triton.jit kernel: also the Python function it compiles
        check.refuse_answer_key(what, f, answers())


def _inputs(n_rows: int, n_cols: int, dtype, gap: int = 5):
    """x (n_rows, n_cols) in a guarded (n_rows, n_cols + gap) buffer; even rows around OFFSET, rows 3, 7... small."""
    full = check.randn((n_rows, n_cols + gap), dtype, scale=3.0, outliers=0.02, outlier_scale=50.0)
    full[::2] = check.randn((n_rows, n_cols + gap), dtype, scale=1.0, offset=OFFSET)[::2]
    full[3::4] = check.randn((n_rows, n_cols + gap), dtype, scale=SMALL)[3::4]
    if gap:
        full[:, n_cols:] = torch.where(torch.rand(n_rows, gap, device=full.device) < 0.5, 3e4, -3e4).to(dtype)
    g = check.guarded_copy(full)
    return g, g.tensor[:, :n_cols]


def _stats64(x: torch.Tensor, eps: float = EPS):
    x64 = x.to("cpu", torch.float64)
    mean = x64.mean(-1)
    return x64, mean, 1.0 / torch.sqrt(((x64 - mean[:, None]) ** 2).mean(-1) + eps)


def _rel(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    g = got.to("cpu", torch.float64)
    return ((g - want).abs() / want.abs().clamp_min(1e-12)).nan_to_num(float("inf"))


def _mean_err(mean: torch.Tensor, want: torch.Tensor, x64: torch.Tensor) -> torch.Tensor:
    """Per row, |mean - want| over the row's largest |x|: the scale of the terms the mean's sum rounds. (Relative
    to the mean itself it would read a float32 mean of a row centred near 0 as inaccurate.) A float32 sum is off by
    about log2(N) float32 roundings of that scale, under 1e-6; a 16-bit one by about 1e-3."""
    return (mean.to("cpu", torch.float64) - want).abs() / x64.abs().amax(-1).clamp_min(1e-30)


#: a mean off by more than this (relative to its row's largest |x|) was not summed in float32
MEAN_F32 = 1e-5


def rstd_rtol(mean64: torch.Tensor, rstd64: torch.Tensor, n_cols: int, eps: float = EPS) -> torch.Tensor:
    """Per row, how far a right float32 two-pass rstd can be from float64's (relative): the float32 mean is
    off by about log2(N) roundings of |mean|, d, so the variance by about d^2 (plus log2(N) roundings of var);
    rstd = 1 / sqrt(var + eps) moves by half that, relative to var + eps."""
    k = max(1, n_cols.bit_length())  # roundings
    var = 1.0 / rstd64 ** 2 - eps
    dvar = (k * F32_EPS * mean64.abs()) ** 2 + k * F32_EPS * var.abs()
    return 1e-4 + 0.5 * dvar / (var + eps)


EPS_HINT = (f"the small rows (variance about {SMALL ** 2:g}) come out as if eps were 1e-5, 1e-6 or 0: the check "
            f"passes eps={EPS:g}. Use the eps argument: rstd = 1 / sqrt(var + eps).")


MASKED_LANES_HINT = ("rstd is wrong: do masked lanes add to the variance? Lanes past n_cols hold 0, and 0 - mean is "
                     "not 0: use tl.where(mask, x - mean, 0.0).")


def _chan_m2(x64: torch.Tensor, block: int, late_delta: bool = False) -> torch.Tensor:
    """M2 per row from Welford chunks merged with Chan's formula, in float64; ``late_delta``: the delta^2 term
    taken from the mean after its update (m_b - m), the usual slip."""
    count, mean, m2 = 0, torch.zeros_like(x64[:, 0]), torch.zeros_like(x64[:, 0])
    for c in x64.split(block, -1):
        n_b, m_b = c.shape[-1], c.mean(-1)
        total = count + n_b
        delta = m_b - mean
        mean = mean + delta * n_b / total
        d2 = (m_b - mean) if late_delta else delta
        m2 = m2 + ((c - m_b[:, None]) ** 2).sum(-1) + d2 * d2 * count * n_b / total
        count = total
    return m2


def diagnose_stats(mean: torch.Tensor, rstd: torch.Tensor, x: torch.Tensor, eps: float = EPS, block=None) -> str:
    """Which known mistake the statistics a kernel stored look like ("" when none fits)."""
    x64, mean64, rstd64 = _stats64(x, eps)
    if bool(torch.isfinite(mean.cpu()).all()) and bool(torch.isnan(rstd.cpu()).any()):
        return ("rstd is NaN: the variance came out negative, as sum(x^2)/n - mean^2 (the one-pass variance) does "
                "on rows around 1000 in float32. Subtract the mean first, then sum the squares.")
    if not bool(torch.isfinite(mean.cpu()).all() and torch.isfinite(rstd.cpu()).all()):
        return ("some statistics are inf or NaN: a 16-bit sum of a row around 1000 overflows (largest float16: "
                "65504): convert x with x.to(tl.float32) before the sums.")
    n = x.shape[-1]
    block = block or triton.next_power_of_2(n)
    first = x64[:, :block]
    if block < n and any(bool((_mean_err(mean, want, x64) < MEAN_F32).all()) for want in (first.mean(-1),
                                                                                      first.sum(-1) / n)):
        return (f"the mean is that of the row's first chunk alone (its first {block} columns): the statistics' pass "
                "loops over every chunk of the row, for start in tl.range(0, n_cols, BLOCK_SIZE), merging each "
                "chunk's count, mean and M2 into the row's.")
    if n < block and bool((_mean_err(mean, mean64 * n / block, x64) < MEAN_F32).all()):
        return "the mean counts BLOCK_SIZE lanes (a whole block, or a partial last chunk as full): divide by n_cols."
    no_mean = 1.0 / torch.sqrt((x64 ** 2).mean(-1) + eps)
    if bool((_rel(rstd, no_mean) < 1e-3).all()):
        return ("rstd matches 1 / sqrt(mean(x^2) + eps): the variance was computed without subtracting the mean. "
                "var = sum((x - mean)^2) / n_cols.")
    small, var64 = slice(3, None, 4), 1.0 / rstd64 ** 2 - eps
    near = lambda want: bool((_rel(rstd, want) <= 2 * rstd_rtol(mean64, rstd64, n, eps)).all())  # noqa: E731
    right = near(rstd64)
    if not right and (near(1.0 / (var64.sqrt() + eps)) or near(1.0 / var64.sqrt() + eps)):
        return ("eps is outside the square root (the small rows, variance about "
                f"{SMALL ** 2:g}, show it): rstd = 1 / sqrt(var + eps), eps added to the variance.")
    if not right and block < n and near((_chan_m2(x64, block, late_delta=True) / n + eps) ** -0.5):
        return ("Chan's merge takes delta from the mean after its update: delta = m_b - m_a must be computed before "
                "m_a moves (m = m_a + delta * n_b / n), and the same delta goes into M2's delta^2 * n_a * n_b / n.")
    if x.shape[0] > 3 and any(bool((_rel(rstd[small], 1 / (var64[small] + e).sqrt()) < 2e-2).all())
                              for e in (1e-5, 1e-6, 0)):
        return EPS_HINT
    if not right and n > 1 and near((var64 * n / (n - 1) + eps) ** -0.5):
        return ("rstd comes from the variance divided by n_cols - 1 (the sample variance, torch.var's default): "
                "LayerNorm's is the population variance, var = sum((x - mean)^2) / n_cols.")
    if not right and any(near(want) for want in (1.0 / rstd64, var64 + eps, var64)):
        return ("the rstd you stored is the variance or the standard deviation sqrt(var + eps), not its reciprocal: "
                "store rstd = 1 / sqrt(var + eps), the factor y (and the backward) multiplies by.")
    pad = (block - n % block) % block   # padded lanes of the row's last (or only) block
    if pad and not right and near((var64 + pad * x64[:, n - n % block:].mean(-1) ** 2 / n + eps) ** -0.5):
        return MASKED_LANES_HINT
    bad = _rel(rstd, rstd64) > rstd_rtol(mean64, rstd64, n, eps)
    if x.shape[0] > 1 and bool(bad[0::2].any()) and not bool(bad[1::2].any()) and \
            bool((_mean_err(mean, mean64, x64) < MEAN_F32).all()):
        return ("rstd is wrong only on the rows around 1000 (the even rows), where sum(x^2)/n - mean^2 keeps only "
                "float32 noise: the one-pass variance. Subtract the mean first, then sum the squares.")
    m2_chunks = sum(((c - c.mean(-1, keepdim=True)) ** 2).sum(-1) for c in x64.split(block, -1))  # Chan's delta^2 lost
    if block < n and bool((_rel(rstd, (m2_chunks / n + eps) ** -0.5) < 1e-3).all()):
        return "rstd is the chunks' own M2 summed: Chan's merge lost its delta^2 * n_a * n_b / n term."
    if bool(((r := _mean_err(mean, mean64, x64)) < 1e-2).all() and ((r > MEAN_F32).any() or
                                                                     (_rel(rstd, rstd64) < 5e-2).all())):
        return ("the statistics are close but not float32-accurate: are they computed in 16 bits (float16/bfloat16 "
                "statistics)? Accumulate the sums in float32.")
    if n % block and bool(bad.any()):
        return MASKED_LANES_HINT
    return ""


def _stride_fault(loads, rows: dict, strides: dict) -> str:
    """'' unless a 2-D input of ``rows`` (``{name: tensor}``) was read with another row stride: every element
    address that stride gives was loaded, and not every one of the tensor's own. ``strides``: the kernel's
    stride and length arguments, ``{argument: value}``."""
    import numpy as np
    loaded = loads.flat()
    for name, t in rows.items():
        r, c = (np.arange(n, dtype=np.int64) for n in t.shape)
        own = t.stride(0)
        addresses = lambda st: (t.data_ptr() + (r[:, None] * st + c[None, :]) * t.element_size()).ravel()  # noqa: E731,B023
        if t.shape[0] < 2 or bool(np.isin(addresses(own).astype(np.uint64), loaded).all()):
            continue
        for other in dict.fromkeys(strides.values()):
            if other != own and bool(np.isin(addresses(other).astype(np.uint64), loaded).all()):
                arg = " and of ".join(a for a, v in strides.items() if v == other)
                return (f"your kernel reads the rows of {name} {other} elements apart, the value of {arg}; {name}'s "
                        f"rows are {own} apart: address row r of {name} as {name}_ptr + r * {name}_row_stride. Each "
                        "tensor has its own row stride.")
    return ""


def store_stride_fault(out, want64: torch.Tensor, name: str, strides: dict) -> str:
    """'' unless the guarded 2-D output ``out`` (a :class:`check.Guarded`) holds ``want64``'s rows at another row
    stride, one of ``strides`` (``{argument: value}``): the rows a kernel stored with that stride, as many as fit
    before the buffer's end guard, each within 1e-2 of its row's largest value."""
    n_rows, n_cols = out.tensor.shape
    own = out.tensor.stride(0)
    flat = out.buffer[check.GUARD:].to("cpu", torch.float64)
    for arg, st in strides.items():
        k = min(n_rows, (flat.numel() - n_cols) // st + 1) if st > 0 else 0
        if st == own or k < 2:
            continue
        got = torch.stack([flat[r * st:r * st + n_cols] for r in range(k)])
        scale = want64[:k].abs().amax(-1, keepdim=True).clamp_min(1e-30)
        if bool(((got - want64[:k]).abs() / scale < 1e-2).all()):
            return (f"your kernel stored the rows of {name} {st} elements apart, the value of {arg}; {name}'s rows "
                    f"are {own} apart: store row r at {name}_ptr + r * {name}_row_stride. Each tensor has its own "
                    "row stride.")
    return ""


def _launch(what, fn, case, hint, inputs=(), rows=None, strides=None):
    """Run the student's launch under load tracking; a crash, a load outside ``inputs`` or an input's rows read
    with another tensor's stride (``rows``: ``{name: tensor}``, ``strides``: ``{argument: value}``) fails, named."""
    from .loads import interpreter_limit
    try:
        with check.track_loads() as loads:
            fn()
    except (NotImplementedError, check.CheckFailure):
        raise
    except Exception as e:  # a crash in the student's kernel: say where
        limit = interpreter_limit(e)
        if limit:
            raise check.CheckFailure(f"{case}: {limit}") from e
        raise check.CheckFailure(f"{case}: your kernel raised {type(e).__name__}: {str(e)[:400]}\n{what}"
                                 + (f"\nHint: {hint}" if hint else "")) from e
    fault = _stride_fault(loads, rows, strides) if rows and loads.active else ""
    if fault:
        raise check.CheckFailure(f"{case}: {fault}")
    check.check_loads_inside(case, loads, list(inputs))
    return loads

