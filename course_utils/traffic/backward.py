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
    """Backward of LayerNorm on a (rows x cols) input: saving ``x_hat`` against recomputing it.

    "store": the forward writes the normalized ``x_hat`` (an extra rows x cols tensor) and the
    backward reads it with dy and w. "recompute": the forward saves only float32 mean and rstd per
    row; the backward reads x, recomputes ``x_hat = (x - mean) * rstd`` in registers. Both write dx
    and float32 partial sums of dw and db (two rows per ``block_m`` rows), reduced by a second kernel.
    """
    m, n = _count("rows", rows), _count("cols", cols)
    b, mn = dtype_bytes(dtype), m * n
    tiles = _cdiv(m, block_m)
    partials = 2 * tiles * n * STAT_BYTES
    reduce = Kernel("dw, db = sum of partial sums", partials, 2 * n * b, 2 * tiles * n)
    store = (Kernel("backward reading x_hat", 2 * mn * b + n * b, mn * b + partials, 8 * mn), reduce)
    recompute = (Kernel("backward recomputing x_hat", 2 * mn * b + n * b + 2 * m * STAT_BYTES, mn * b + partials,
                        10 * mn), reduce)
    return Comparison(f"LayerNorm backward on {m}x{n} {dtype_name(dtype)}",
                      Traffic("x_hat stored", store), Traffic("x_hat recomputed", recompute),
                      (f"saved_bytes stored={mn * b}", f"saved_bytes recomputed={2 * m * STAT_BYTES}",
                       "the forward that stores x_hat also writes it: rows*cols*bytes more forward traffic"))


DQ_MODES = ("separate", "atomic")


def attention_backward(batch, heads, seq_len, head_dim, dtype="bfloat16", *, causal=False, block_m=64,
                       block_n=64, dq="separate") -> Comparison:
    """Attention backward: P saved by the forward (standard) against P recomputed (FlashAttention).

    Standard (five kernels per pass; the forward kept P, N x N): dV = P^T dO, dP = dO V^T,
    dS = P * (dP - rowsum(dP * P)) (softmax's backward), dQ = dS K, dK = dS^T Q.
    Flash: a preprocessing kernel ``D = rowsum(dO * O)``; one program per key tile of ``block_n``
    rows keeps its K, V, dK, dV on chip and walks the query tiles, reading Q, dO, the log-sum-exp
    and D of each (all of them per key tile: fewer when causal), recomputing S and P = exp(S - lse).
    dQ: ``"separate"``, a second pass with one program per query tile that re-reads K and V per
    tile; or ``"atomic"``, float32 atomic adds into dQ from every key tile (a read and a write of dQ
    per key tile, and a conversion kernel). FLOPs: standard 4 products (8 B H N^2 d); flash
    recomputes Q K^T (one product more, and a second one for dP in the separate dQ pass).
    """
    bsz, h = _count("batch", batch), _count("heads", heads)
    n, d = _count("seq_len", seq_len), _count("head_dim", head_dim)
    if dq not in DQ_MODES:
        raise ValueError(f"dq must be one of {DQ_MODES}, got {dq!r}")
    b, bh = dtype_bytes(dtype), bsz * h
    t = bh * n * d * b                    # one of Q, K, V, O, dO, dQ, dK, dV
    s = bh * n * n * b                    # one N x N matrix per (batch, head)
    mm = 2.0 * bh * n * n * d             # one of the N x N x d products
    half = 0.5 if causal else 1.0
    standard = (Kernel("dV = P^T dO", s + t, t, mm), Kernel("dP = dO V^T", 2 * t, s, mm),
                Kernel("dS = P * (dP - rowsum(dP * P))", 2 * s, s, 4.0 * bh * n * n),
                Kernel("dQ = dS K", s + t, t, mm), Kernel("dK = dS^T Q", s + t, t, mm))
    stats = bh * n * STAT_BYTES
    q_rows = flash_kv_rows(n, block_n, causal)       # query rows a key tile visits, summed over key tiles
    per_tile_q = bh * q_rows * (2 * d * b + 2 * STAT_BYTES)     # Q, dO, lse and D of every visited query row
    flash = [Kernel("D = rowsum(dO * O)", 2 * t, stats, 2.0 * bh * n * d),
             Kernel("dK, dV per key tile", 2 * t + per_tile_q, 2 * t, (4 if dq == "separate" else 5) * mm * half)]
    if dq == "separate":
        kv_rows = flash_kv_rows(n, block_m, causal)
        flash.append(Kernel("dQ per query tile", 2 * t + 2 * stats + 2 * bh * kv_rows * d * b, t, 3 * mm * half))
    else:
        atomics = _cdiv(n, block_n) * bh * n * d * STAT_BYTES
        flash += [Kernel("dQ float32 atomics (inside the key-tile kernel)", atomics, atomics, 0.0),
                  Kernel("dQ float32 -> dtype", bh * n * d * STAT_BYTES, t, 0.0)]
    return Comparison(f"attention backward B={bsz} H={h} N={n} d={d} {dtype_name(dtype)}"
                      + (" causal" if causal else "") + f", dQ {dq}",
                      Traffic("standard (P saved)", standard), Traffic("flash (P recomputed)", tuple(flash)),
                      (f"saved_bytes standard={s}", f"saved_bytes flash={stats}"))


__all__ = ["MASK_BYTES", "STAT_BYTES", "DQ_MODES", "bias_gelu_backward", "layernorm_backward", "attention_backward"]
