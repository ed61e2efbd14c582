"""Calculators for the course's memory-bound fusions: elementwise chains, GELU, softmax,
bias + GELU + dropout and LayerNorm (unfused: one kernel per eager op; fused: one kernel)."""

from __future__ import annotations

import warnings

from .model import Comparison, Kernel, Traffic, _operand_elems, _ops
from .units import _count, _shape, dtype_bytes, dtype_name


def elementwise_chain(ops, shape, dtype="bfloat16") -> Comparison:
    """Traffic of an elementwise chain, one kernel per op vs one fused kernel.

    ``ops``: a chain length (that many unary ops) or a list of :class:`Op` / op names.
    ``shape``: numel, or a tuple whose last entry is the number of columns (needed for ``"col"``).
    """
    ops = _ops(ops)
    rows, cols = _shape(shape)
    b = dtype_bytes(dtype)
    n = rows * cols
    kernels = []
    for i, op in enumerate(ops):
        extra = sum(_operand_elems(k, rows, cols) for k in op.operands)
        # the running value (x for the first op) was written (or, for x, read) by the previous kernel
        reuse = n if i > 0 else 0
        if i > 0 and (i == 1 or "input" in ops[i - 1].operands):  # x itself, if the previous kernel read it
            reuse += sum(_operand_elems(k, rows, cols) for k in op.operands if k == "input")
        kernels.append(Kernel(op.name, (n + extra) * b, n * b, op.flops * n, reuse * b))
    fused_extra = sum(_operand_elems(k, rows, cols) for op in ops for k in op.operands if k != "input")
    fused = Kernel("fused " + "+".join(o.name for o in ops), (n + fused_extra) * b, n * b,
                   sum(o.flops for o in ops) * n)
    name = f"chain of {len(ops)} op(s) on {rows}x{cols} {dtype_name(dtype)}"
    return Comparison(name, Traffic("unfused", tuple(kernels)), Traffic("fused", (fused,)))


#: The tanh-GELU of chapter 4 written as 9 eager torch ops:
#: 0.5 * x * (1 + tanh(0.79788456 * (x + 0.044715 * x * x * x))), evaluated left to right as
#: t1 = x*x, t2 = t1*x, t3 = 0.044715*t2, t4 = x+t3, t5 = 0.79788456*t4, t6 = tanh(t5), t7 = 1+t6,
#: t8 = 0.5*x, y = t8*t7. Ops 1, 2 and 4 read x again and op 8 starts from x, so this is no simple chain:
#: :func:`gelu_eager` counts it kernel by kernel.
def gelu_eager(shape, dtype="bfloat16") -> Comparison:
    """The 9-op eager tanh-GELU vs one fused kernel (read x once, write y once)."""
    rows, cols = _shape(shape)
    b = dtype_bytes(dtype)
    n = rows * cols * b
    # (name, tensors read, reads of a tensor the previous kernel touched)
    plan = [("x*x", 2, 0), ("t1*x", 2, 2), ("0.044715*t2", 1, 1), ("x+t3", 2, 1), ("0.798*t4", 1, 1),
            ("tanh", 1, 1), ("1+t6", 1, 1), ("0.5*x", 1, 0), ("t8*t7", 2, 1)]
    kernels = tuple(Kernel(name, reads * n, n, rows * cols, reuse * n) for name, reads, reuse in plan)
    fused = Kernel("fused gelu", n, n, 9 * rows * cols)
    return Comparison(f"9-op eager GELU on {rows}x{cols} {dtype_name(dtype)}",
                      Traffic("unfused", kernels), Traffic("fused", (fused,)))



def softmax(rows, cols, dtype="float32") -> Comparison:
    """Softmax along rows: five eager ops vs one fused pass.

    Eager: ``m = x.amax(1)`` (read MN, write M), ``z = x - m`` (read MN + M, write MN),
    ``e = exp(z)`` (read MN, write MN), ``s = e.sum(1)`` (read MN, write M), ``y = e / s``
    (read MN + M, write MN): reads 5MN + 2M and writes 3MN + 2M elements. Fused: reads MN, writes MN.
    """
    m, n = _count("rows", rows), _count("cols", cols)
    b = dtype_bytes(dtype)
    mn = m * n
    kernels = (
        Kernel("amax", mn * b, m * b, mn, 0),
        Kernel("sub", (mn + m) * b, mn * b, mn, (mn + m) * b),
        Kernel("exp", mn * b, mn * b, mn, mn * b),
        Kernel("sum", mn * b, m * b, mn, mn * b),
        Kernel("div", (mn + m) * b, mn * b, mn, mn * b),
    )
    fused = Kernel("fused softmax", mn * b, mn * b, 5 * mn)
    return Comparison(f"softmax of {m}x{n} {dtype_name(dtype)}", Traffic("unfused", kernels),
                      Traffic("fused", (fused,)))


MASK_MODES = ("saved", "generated")


def bias_gelu_dropout(rows, cols, dtype="float16", *, mask="generated", mask_dtype="bool") -> Comparison:
    """``dropout(gelu(x + bias))`` with a per-column bias: three eager kernels vs one fused kernel.

    Dropout never reads random numbers from HBM: eager PyTorch's ``native_dropout`` draws them in
    its kernel (Philox) and writes the output plus, in training, the keep-mask (``mask_dtype``, 1
    byte per element for bool) that the backward pass reads. ``mask="saved"`` counts that mask
    write; ``"generated"`` counts none: nothing is saved, and a backward pass regenerates the mask
    from the same seed and offsets (what the course's fused kernel allows). The same choice applies
    to both versions, so compare ``bias_gelu_dropout(..., mask="saved").unfused`` (eager training)
    with ``mask="generated"``'s fused kernel for the course's own design. (``"read"``, the old name,
    modelled a random tensor read back from HBM, which no eager dropout does: it now means
    ``"saved"`` and warns.)
    """
    m, n = _count("rows", rows), _count("cols", cols)
    if mask == "read":
        warnings.warn("bias_gelu_dropout(mask='read') is counted as mask='saved': eager dropout does not "
                      "read a random tensor from HBM; native_dropout draws in-kernel and writes a 1-byte "
                      "mask for backward. Pass mask='saved' (or 'generated').", FutureWarning, stacklevel=2)
        mask = "saved"
    if mask not in MASK_MODES:
        raise ValueError(f"mask must be one of {MASK_MODES}, got {mask!r}")
    b = dtype_bytes(dtype)
    mb = dtype_bytes(mask_dtype) if mask == "saved" else 0
    mn = m * n
    kernels = (
        Kernel("x + bias", (mn + n) * b, mn * b, mn, 0),
        Kernel("gelu", mn * b, mn * b, 9 * mn, mn * b),
        Kernel("dropout" + (" (output + mask)" if mb else ""), mn * b, mn * b + mn * mb, 2 * mn, mn * b),
    )
    fused = Kernel("fused bias+gelu+dropout", (mn + n) * b, mn * b + mn * mb, 12 * mn)
    return Comparison(f"bias + GELU + dropout ({mask} mask) on {m}x{n} {dtype_name(dtype)}",
                      Traffic("unfused", kernels), Traffic("fused", (fused,)))


STATS_BYTES = 4  # mean and rstd are float32 for every input dtype


def layernorm(rows, cols, dtype="float32", *, save_stats=False) -> Comparison:
    """LayerNorm over rows of length ``cols`` with weight and bias: nine eager ops vs one kernel.

    Eager (the pattern torch.compile recognises): ``mean`` (read MN, write M), ``x - mean``
    (MN + M, MN), ``pow 2`` (MN, MN), ``mean`` (MN, M), ``+ eps`` (M, M), ``sqrt`` (M, M),
    ``/ std`` (MN + M, MN), ``* weight`` (MN + N, MN), ``+ bias`` (MN + N, MN): reads 7MN + 4M + 2N,
    writes 5MN + 4M elements. Fused: reads MN + 2N, writes MN (+ 2M float32 values, whatever the
    input's dtype, when it saves mean and rstd for the backward pass, ``save_stats=True``).
    """
    m, n = _count("rows", rows), _count("cols", cols)
    b = dtype_bytes(dtype)
    mn = m * n
    k = [("mean", mn, m, 0), ("x - mean", mn + m, mn, mn + m), ("pow 2", mn, mn, mn), ("mean", mn, m, mn),
         ("+ eps", m, m, m), ("sqrt", m, m, m), ("/ std", mn + m, mn, m), ("* weight", mn + n, mn, mn),
         ("+ bias", mn + n, mn, mn)]
    kernels = tuple(Kernel(name, r * b, w * b, max(r, w), reuse * b) for name, r, w, reuse in k)
    stats = 2 * m * STATS_BYTES if save_stats else 0
    fused = Kernel("fused layernorm", (mn + 2 * n) * b, mn * b + stats, 8 * mn)
    return Comparison(f"LayerNorm of {m}x{n} {dtype_name(dtype)}", Traffic("unfused", kernels),
                      Traffic("fused", (fused,)))


def causal_mask_eager(batch, heads, n_q, n_kv, dtype="bfloat16", mask_dtype="bool") -> Traffic:
    """The kernels eager attention (``attention_ref``) adds for a causal mask, besides its three.

    ``torch.ones(n_q, n_kv, dtype=bool)`` (writes the mask), ``.triu(...)`` (reads it, writes a new
    one), then ``s.masked_fill_(drop, -inf)`` in place over the scores S of every (batch, head):
    reads S and the mask (broadcast: counted once), writes S back. The last kernel moves S twice,
    which is as much as the softmax kernel itself.
    """
    bh = _count("batch", batch) * _count("heads", heads)
    m, n = _count("n_q", n_q), _count("n_kv", n_kv)
    b, mb = dtype_bytes(dtype), dtype_bytes(mask_dtype)
    s, mask = bh * m * n * b, m * n * mb
    return Traffic("causal mask, eager", (
        Kernel("ones (mask)", 0, mask, 0),
        Kernel("triu (mask)", mask, mask, m * n),
        Kernel("S.masked_fill_(mask, -inf)", s + mask, s, bh * m * n, mask),
    ))


__all__ = ["elementwise_chain", "gelu_eager", "softmax", "MASK_MODES", "bias_gelu_dropout", "layernorm",
           "causal_mask_eager"]
