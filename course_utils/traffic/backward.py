"""The backward pass as fusion accounting (chapter 11): what the forward saves, what the backward
recomputes, and the bytes and FLOPs of each choice.

Same conventions as the forward calculators: logical traffic (each tensor a kernel takes is read
once, each it produces written once), elements x bytes per element. Unfused is what autograd runs
through eager PyTorch's ops; fused is the course's kernels. ``saved_bytes`` in a comparison's notes
is what stays in memory between forward and backward (activation memory).
"""

from __future__ import annotations

from .matmul import flash_kv_rows
from .model import Comparison, Kernel, Traffic
from .units import _count, dtype_bytes, dtype_name

MASK_BYTES = 1      # native_dropout's saved bool mask: one byte per element
STAT_BYTES = 4      # float32 statistics (mean, rstd, log-sum-exp, delta)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def bias_gelu_backward(rows, cols, dtype="bfloat16", *, p=0.0, block_m=32) -> Comparison:
    """Backward of ``dropout(gelu(x + b), p)`` on a (rows x cols) tensor.

    Eager autograd saves ``z = x + b`` (for GELU's backward) and, with dropout, a 1-byte mask; its
    backward runs dropout's backward (reads dy and the mask), GELU's backward (reads the result and
    z) and the bias gradient (a column sum of dz). The fused backward saves nothing but the forward's
    input ``x`` and the seed: one kernel reads dy, x and b, recomputes z, gelu'(z) and the mask, writes
    dx and float32 partial column sums (one row of them per ``block_m`` rows), which a tiny second
    kernel sums into db.
    """
    m, n = _count("rows", rows), _count("cols", cols)
    b, mn = dtype_bytes(dtype), m * n
    dropout = p > 0.0
    eager = []
    if dropout:
        eager.append(Kernel("dropout backward", mn * b + mn * MASK_BYTES, mn * b, mn, 0))
    eager += [Kernel("gelu backward", 2 * mn * b, mn * b, 20 * mn, mn * b if dropout else 0),
              Kernel("db = sum(dz, rows)", mn * b, n * b, mn, mn * b)]
    tiles = _cdiv(m, block_m)
    fused = (Kernel("fused bias+gelu(+dropout) backward", 2 * mn * b + n * b, mn * b + tiles * n * STAT_BYTES, 30 * mn),
             Kernel("db = sum of partial sums", tiles * n * STAT_BYTES, n * b, tiles * n))
    saved_eager = mn * b + (mn * MASK_BYTES if dropout else 0)
    saved_fused = mn * b                 # x (the forward's input); the mask is regenerated from the seed
    return Comparison(f"bias+GELU{'+dropout' if dropout else ''} backward on {m}x{n} {dtype_name(dtype)}",
                      Traffic("eager autograd", tuple(eager)), Traffic("fused", fused),
                      (f"saved_bytes eager={saved_eager}", f"saved_bytes fused={saved_fused}"))


def layernorm_backward(rows, cols, dtype="bfloat16", *, block_m=64) -> Comparison:
    """Backward of LayerNorm on a (rows x cols) input, eager against fused; and what storing x_hat would add.

    Neither stores ``x_hat``: eager PyTorch's ``native_layer_norm`` saves float32 mean and rstd per
    row (with the input x and the weight, which exist anyway; ``grad_fn._saved_result1/2``), and its
    CUDA backward runs at least two kernels, dx and then dw and db, each reading dy, x, mean and rstd
    and recomputing ``x_hat`` (counted here as two).
    The fused backward reads dy and x once, writes dx and float32 partial sums of dw and db (two rows
    per ``block_m`` rows), reduced by a second kernel. The notes also give the bytes a forward that
    stored ``x_hat`` instead would keep (``saved_bytes x_hat``): a whole rows x cols tensor.
    """
    m, n = _count("rows", rows), _count("cols", cols)
    b, mn = dtype_bytes(dtype), m * n
    tiles = _cdiv(m, block_m)
    stats = 2 * m * STAT_BYTES
    partials = 2 * tiles * n * STAT_BYTES
    eager = (Kernel("dx (recomputes x_hat)", 2 * mn * b + n * b + stats, mn * b, 8 * mn),
             Kernel("dw, db (recomputes x_hat)", 2 * mn * b + stats, 2 * n * b, 4 * mn))
    fused = (Kernel("dx + partial dw, db", 2 * mn * b + n * b + stats, mn * b + partials, 10 * mn),
             Kernel("dw, db = sum of partial sums", partials, 2 * n * b, 2 * tiles * n))
    return Comparison(f"LayerNorm backward on {m}x{n} {dtype_name(dtype)}",
                      Traffic("eager (mean, rstd saved)", eager), Traffic("fused (mean, rstd saved)", fused),
                      (f"saved_bytes eager={stats}", f"saved_bytes fused={stats}", f"saved_bytes x_hat={mn * b}"))


DQ_MODES = ("separate", "atomic")
# Matrix products of N x N x d per (query tile, key tile) pair, 2 N^2 d FLOPs each for a whole head.
FORWARD_PRODUCTS = 2                # S = Q K^T, O = P V
STANDARD_BACKWARD_PRODUCTS = 4     # from the saved P: dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q
# FlashAttention recomputes S. With dQ in a pass of its own (the course's default), the dK/dV pass
# computes S, dV, dP, dK (4) and the dQ pass S and dP again, then dQ (3): 7. FlashAttention-2's
# single pass (dQ by atomic adds from the key-tile programs) computes S, dV, dP, dK, dQ once: 5.
BACKWARD_PRODUCTS = {"separate": 7, "atomic": 5}


def backward_flop_factor(dq: str = "separate") -> float:
    """Backward FLOPs / forward FLOPs of FlashAttention: 7 / 2 = 3.5 with the separate dQ pass, 5 / 2 = 2.5
    in FlashAttention-2's single pass (the convention its paper and most benchmarks use)."""
    if dq not in DQ_MODES:
        raise ValueError(f"dq must be one of {DQ_MODES}, got {dq!r}")
    return BACKWARD_PRODUCTS[dq] / FORWARD_PRODUCTS


def attention_backward(batch, heads, seq_len, head_dim, dtype="bfloat16", *, causal=False, block_m=64,
                       block_n=64, dq="separate") -> Comparison:
    """Attention backward: P saved by the forward (standard) against P recomputed (FlashAttention).

    Both versions are counted the same way, logical traffic: each kernel reads each tensor it needs
    once and writes each result once. Standard (the forward kept P, N x N): dV = P^T dO, dP = dO V^T,
    dS = P * (dP - rowsum(dP * P)), dQ = dS K, dK = dS^T Q, five kernels, 4 products. Flash: D =
    rowsum(dO * O); a dK/dV kernel (one program per key tile of ``block_n`` rows) reading Q, K, V, dO,
    lse and D; and either (``"separate"``) a dQ kernel reading the same, or (``"atomic"``) float32
    atomic adds of dQ from the dK/dV kernel and a conversion kernel. FLOPs: ``BACKWARD_PRODUCTS[dq]``
    products (7 or 5), halved when causal (the flash kernels skip the tiles above the diagonal).
    What tiling adds on top, each key tile re-reading its query rows (and each query tile its key
    rows, or each key tile's atomics re-reading dQ), is :func:`attention_backward_rereads`.
    """
    bsz, h = _count("batch", batch), _count("heads", heads)
    n, d = _count("seq_len", seq_len), _count("head_dim", head_dim)
    backward_flop_factor(dq)  # validates dq
    b, bh = dtype_bytes(dtype), bsz * h
    t = bh * n * d * b                    # one of Q, K, V, O, dO, dQ, dK, dV
    s = bh * n * n * b                    # one N x N matrix per (batch, head)
    mm = 2.0 * bh * n * n * d             # one of the N x N x d products
    half = 0.5 if causal else 1.0
    standard = (Kernel("dV = P^T dO", s + t, t, mm), Kernel("dP = dO V^T", 2 * t, s, mm),
                Kernel("dS = P * (dP - rowsum(dP * P))", 2 * s, s, 4.0 * bh * n * n),
                Kernel("dQ = dS K", s + t, t, mm), Kernel("dK = dS^T Q", s + t, t, mm))
    stats = bh * n * STAT_BYTES
    fp32_dq = bh * n * d * STAT_BYTES
    flash = [Kernel("D = rowsum(dO * O)", 2 * t, stats, 2.0 * bh * n * d),
             Kernel("dK, dV per key tile" + (" (+ dQ atomics)" if dq == "atomic" else ""),
                    4 * t + 2 * stats, 2 * t + (fp32_dq if dq == "atomic" else 0),
                    (4 if dq == "separate" else 5) * mm * half)]
    if dq == "separate":
        flash.append(Kernel("dQ per query tile", 4 * t + 2 * stats, t, 3 * mm * half))
    else:
        flash.append(Kernel("dQ float32 -> dtype", fp32_dq, t, 0.0))
    return Comparison(f"attention backward B={bsz} H={h} N={n} d={d} {dtype_name(dtype)}"
                      + (" causal" if causal else "") + f", dQ {dq}",
                      Traffic("standard (P saved)", standard), Traffic("flash (P recomputed)", tuple(flash)),
                      (f"saved_bytes standard={s}", f"saved_bytes flash={stats}"))


def attention_backward_rereads(batch, heads, seq_len, head_dim, dtype="bfloat16", *, causal=False, block_m=64,
                               block_n=64, dq="separate") -> int:
    """Bytes the flash backward's tiles read (or, for atomics, read and write) beyond its logical traffic
    if no re-read hit in L2: each key tile reads Q, dO, lse and D of every query row it visits, each
    query tile of the dQ pass K and V of every key row it visits, each key tile's atomics read and
    write the float32 dQ rows it visits. An upper bound: L2 serves part of it."""
    bsz, h = _count("batch", batch), _count("heads", heads)
    n, d = _count("seq_len", seq_len), _count("head_dim", head_dim)
    backward_flop_factor(dq)
    b, bh = dtype_bytes(dtype), bsz * h
    q_rows = flash_kv_rows(n, block_n, causal)       # query rows the key tiles visit, summed over key tiles
    extra = bh * (q_rows - n) * (2 * d * b + 2 * STAT_BYTES)
    if dq == "separate":
        extra += bh * (flash_kv_rows(n, block_m, causal) - n) * 2 * d * b
    else:
        extra += bh * (2 * q_rows - n) * d * STAT_BYTES   # a read and a write per visit; one write is logical
    return extra


__all__ = ["MASK_BYTES", "STAT_BYTES", "DQ_MODES", "FORWARD_PRODUCTS", "STANDARD_BACKWARD_PRODUCTS",
           "BACKWARD_PRODUCTS", "backward_flop_factor", "bias_gelu_backward", "layernorm_backward",
           "attention_backward", "attention_backward_rereads"]
