"""Calculators around a matmul: ops before and after a GEMM (its prologue and epilogue), and
attention forward, standard against FlashAttention-style tiling."""

from __future__ import annotations

import math
from collections.abc import Iterable

from .model import Comparison, Kernel, Op, Traffic, _ops
from .ops import elementwise_chain
from .units import _count, dtype_bytes, dtype_name

TRAILING_MODES = ("eager", "fused", "addmm")


def _op_list(name: str, ops) -> tuple[Op, ...]:
    """Like :func:`_ops` but an empty list is allowed (no ops on that side of the matmul)."""
    if isinstance(ops, (str, Op)) or not isinstance(ops, Iterable):
        raise ValueError(f"{name} must be a list of ops, got {ops!r}")
    return tuple(o if isinstance(o, Op) else Op(o) for o in ops)


def matmul_chain(pre, post, m, n, k, dtype="bfloat16", *, trailing="eager") -> Comparison:
    """Ops on A before ``C = A @ B`` and on C after it (A is m x k, B is k x n): the fusion accountant.

    ``pre`` ops act on A elementwise, or row-wise like a softmax over the k entries of a row (a
    fused kernel can apply it in the GEMM's prologue only if it holds whole rows, as FlashAttention
    does); ``post`` ops act on C (the epilogue). The GEMM reads its A and B once each from HBM (its
    tiles re-read them from L2: the ideal a good GEMM approaches) and writes C.
    Unfused: one kernel per op and one for the GEMM; with ``trailing="fused"`` the ops on each side
    run as one elementwise kernel instead; ``trailing="addmm"`` is what PyTorch's ``addmm`` with a 1-D
    bias runs: a leading "add bias" on C goes into cuBLASLt's own epilogue (the GEMM kernel reads the
    bias), every later op is one kernel. Fused: one kernel reads A, B and every operand once and
    writes the final result.
    """
    pre, post = _op_list("pre", pre), _op_list("post", post)
    m, n, k = _count("m", m), _count("n", n), _count("k", k)
    if trailing not in TRAILING_MODES:
        raise ValueError(f"trailing must be one of {TRAILING_MODES}, got {trailing!r}")
    b = dtype_bytes(dtype)
    kernels: list[Kernel] = []
    extra = 0  # bytes of the ops' own operands (a bias...)
    if pre:
        chain = elementwise_chain(pre, (m, k), dtype)
        kernels += chain.fused.kernels if trailing == "fused" else chain.unfused.kernels
        extra += chain.fused.read_bytes - m * k * b
    in_gemm = ()
    if trailing == "addmm" and post and post[0].name == "add bias" and post[0].operands == ("col",):
        in_gemm, post = post[:1], post[1:]   # cuBLASLt's bias epilogue: the GEMM reads the N biases itself
    gemm = Kernel("gemm + bias" if in_gemm else "gemm", (m * k + k * n + (n if in_gemm else 0)) * b, m * n * b,
                  2.0 * m * n * k + (m * n if in_gemm else 0), m * k * b if pre else 0)
    kernels.append(gemm)
    if post:
        chain = elementwise_chain(post, (m, n), dtype)
        tail = chain.fused.kernels if trailing == "fused" else chain.unfused.kernels
        kernels += [Kernel(t.name, t.read_bytes, t.write_bytes, t.flops, t.reuse_bytes or m * n * b) if i == 0
                    else t for i, t in enumerate(tail)]
        extra += chain.fused.read_bytes - m * n * b
    flops = sum(kk.flops for kk in kernels)
    fused = Kernel("fused " + " + ".join([*(o.name for o in pre), "gemm", *(o.name for o in (*in_gemm, *post))]),
                   gemm.read_bytes + extra, m * n * b, flops)
    name = " + ".join([*(o.name for o in pre), f"GEMM {m}x{n}x{k}", *(o.name for o in (*in_gemm, *post))]) \
        + f", {dtype_name(dtype)}"
    return Comparison(name, Traffic(f"unfused ({trailing} ops)", tuple(kernels)), Traffic("fused", (fused,)))


#: The epilogue of chapter 9 unless told otherwise: a bias per column, then GELU (9 FLOPs per element).
DEFAULT_EPILOGUE = (Op("add bias", ("col",)), Op("gelu", (), 9))


def gemm_epilogue(m, n, k, epilogue=DEFAULT_EPILOGUE, dtype="bfloat16", *,
                  trailing="eager") -> Comparison:
    """``C = A @ B`` followed by elementwise ops on C: trailing kernels vs the GEMM's epilogue.

    The special case of :func:`matmul_chain` with no ops before the matmul; ``trailing="eager"``
    runs one kernel per epilogue op after the GEMM, ``"fused"`` one elementwise kernel for all of them,
    ``"addmm"`` the bias inside cuBLASLt's GEMM and one kernel per later op (PyTorch's ``addmm`` + GELU:
    2 kernels, the baseline the benchmark times).
    """
    return matmul_chain((), _ops(epilogue), m, n, k, dtype, trailing=trailing)


def flash_kv_rows(seq_len: int, block_m: int, causal: bool) -> int:
    """Rows of K (and of V) that a FlashAttention forward loads for one head.

    Each query tile of ``block_m`` rows streams all of K and V (``seq_len`` rows each), or, when
    causal, only the rows up to the end of its own tile.
    """
    n_tiles = math.ceil(seq_len / block_m)
    if not causal:
        return n_tiles * seq_len
    return sum(min(seq_len, (i + 1) * block_m) for i in range(n_tiles))


KV_READS = ("per_tile", "once")


def attention(batch, heads, seq_len, head_dim, dtype="bfloat16", *, causal=False, block_m=128,
              save_lse=False, kv_reads="per_tile") -> Comparison:
    """Attention forward: standard (S and P materialized) vs FlashAttention-style tiling.

    Standard, three kernels per (batch, head): ``S = Q K^T`` (scale folded into it; reads Q, K,
    writes S: N x N), ``P = softmax(S)`` (causal mask applied there; reads S, writes P), ``O = P V``
    (reads P and V, writes O). Causal or not, S and P are full N x N matrices.
    Flash, one kernel: reads Q once, K and V once per query tile of ``block_m`` rows (fewer when
    causal: :func:`flash_kv_rows`), writes O (and the log-sum-exp per row, fp32, if ``save_lse``).
    Counting every K/V re-read as HBM traffic (``kv_reads="per_tile"``, the FlashAttention paper's
    count) is an upper bound: the L2 serves many of them. ``kv_reads="once"`` is the lower bound
    where K and V come from HBM once and every re-read hits L2.
    FLOPs: 4 B H N^2 d for the two products (halved for causal in the flash kernel only).
    """
    bsz, h = _count("batch", batch), _count("heads", heads)
    n, d = _count("seq_len", seq_len), _count("head_dim", head_dim)
    bm = _count("block_m", block_m)
    if kv_reads not in KV_READS:
        raise ValueError(f"kv_reads must be one of {KV_READS}, got {kv_reads!r}")
    b = dtype_bytes(dtype)
    bh = bsz * h
    qkv = bh * n * d * b  # one of Q, K, V or O
    s = bh * n * n * b
    mm = 2.0 * bh * n * n * d
    standard = (
        Kernel("S = Q K^T", 2 * qkv, s, mm, 0),
        Kernel("P = softmax(S)", s, s, 5.0 * bh * n * n, s),
        Kernel("O = P V", s + qkv, qkv, mm, s),
    )
    kv = 2 * bh * (flash_kv_rows(n, bm, causal) if kv_reads == "per_tile" else n) * d * b
    lse = bh * n * 4 if save_lse else 0
    flash = Kernel("flash attention", qkv + kv, qkv + lse, 2 * mm * (0.5 if causal else 1.0))
    return Comparison(f"attention B={bsz} H={h} N={n} d={d} {dtype_name(dtype)}"
                      + (" causal" if causal else "") + (", K/V read once" if kv_reads == "once" else ""),
                      Traffic("standard", standard), Traffic("flash", (flash,)))


__all__ = ["TRAILING_MODES", "matmul_chain", "gemm_epilogue", "flash_kv_rows", "KV_READS", "attention"]
