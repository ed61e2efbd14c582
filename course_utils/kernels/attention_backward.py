"""FlashAttention backward: dQ, dK, dV from what the forward kept (O and the log-sum-exp), never P.

With S = Q K^T * scale, P = softmax(S) = exp(S - lse) and O = P V, the chain rule gives
    dV = P^T dO,   dP = dO V^T,   dS = P * (dP - D),   dQ = scale * dS K,   dK = scale * dS^T Q,
where D = rowsum(dO * O) (= rowsum(P * dP), one number per query row). Nothing N x N is stored:
P is recomputed tile by tile from Q, K and the forward's lse.

Version ladder (chapter 11):
  v0 ``attention_backward_ref``: torch autograd through ``attention_ref`` (S, P, dP, dS in HBM).
  v1 ``flash_attention_backward_teaching``: three kernels -- ``attn_bwd_preprocess_kernel`` (D),
     ``attn_bwd_dkdv_kernel`` (one program per key tile: loops over the query tiles, and over the
     q heads of a grouped-query group, accumulating dK and dV in registers) and
     ``attn_bwd_dq_kernel`` (one program per query tile: loops over the key tiles). dQ gets its
     own pass rather than atomic adds from the dK/dV programs: every output is written once by one
     program (deterministic, no fp32 scratch buffer), at the cost of recomputing S and dP a second
     time: 7 products of N x N x d per head, against 5 in FlashAttention-2's single pass
     (``course_utils.traffic.backward.BACKWARD_PRODUCTS``). float32 inputs multiply in IEEE float32.
  v2 ``course_utils.tuned.attention_backward``: v1 in base 2, masks only on diagonal tiles,
     software pipelining, tiles per device, and the autograd Function ``flash_attention_autograd``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention import attention_ref, block_d, head_offset, tile_offsets, validate


@triton.jit
def attn_bwd_preprocess_kernel(o_ptr, do_ptr, delta_ptr,
                               stride_ob, stride_oh, stride_on, stride_od,
                               stride_dob, stride_doh, stride_don, stride_dod,
                               n_heads, n_q, head_dim, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    # D = rowsum(dO * O), one float32 per query row.
    pid = tl.program_id(0)
    n_m_tiles = tl.cdiv(n_q, BLOCK_M)
    pid_m = pid % n_m_tiles
    pid_bh = pid // n_m_tiles
    b = pid_bh // n_heads
    h = pid_bh % n_heads
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < n_q) & (offs_d[None, :] < head_dim)
    o = tl.load(o_ptr + head_offset(b, h, stride_ob, stride_oh)
                + tile_offsets(offs_m, offs_d, stride_on, stride_od), mask=mask, other=0.0)
    do = tl.load(do_ptr + head_offset(b, h, stride_dob, stride_doh)
                 + tile_offsets(offs_m, offs_d, stride_don, stride_dod), mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(delta_ptr + pid_bh.to(tl.int64) * n_q + offs_m, delta, mask=offs_m < n_q)


@triton.jit
def recompute_p(q, k, lse, rows, cols, n_q, n_kv, causal_offset, sm_scale, CAUSAL: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    """P = exp(Q K^T * scale - lse) for one (query tile x key tile), 0 where masked or padded."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale
    p = tl.exp(s - lse[:, None])
    keep = (rows[:, None] < n_q) & (cols[None, :] < n_kv)
    if CAUSAL:
        keep = keep & (cols[None, :] <= rows[:, None] + causal_offset)
    return tl.where(keep, p, 0.0)


@triton.jit
def attn_bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
                         stride_qb, stride_qh, stride_qn, stride_qd,
                         stride_kb, stride_kh, stride_kn, stride_kd,
                         stride_vb, stride_vh, stride_vn, stride_vd,
                         stride_dob, stride_doh, stride_don, stride_dod,
                         n_heads, group, n_q, n_kv, head_dim, causal_offset, sm_scale,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # torch.compile passes floats as fp64: keep the math in float32 (tl.cast: the interpreter passes a Python float)
    sm_scale = tl.cast(sm_scale, tl.float32)
    # One program per (key tile, batch * kv head). dk, dv have k's (contiguous) shape.
    pid = tl.program_id(0)
    n_n_tiles = tl.cdiv(n_kv, BLOCK_N)
    pid_n = pid % n_n_tiles
    pid_bkv = pid // n_n_tiles
    n_kv_heads = n_heads // group
    b = pid_bkv // n_kv_heads
    h_kv = pid_bkv % n_kv_heads
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = (cols[:, None] < n_kv) & (offs_d[None, :] < head_dim)
    k = tl.load(k_ptr + head_offset(b, h_kv, stride_kb, stride_kh)
                + tile_offsets(cols, offs_d, stride_kn, stride_kd), mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + head_offset(b, h_kv, stride_vb, stride_vh)
                + tile_offsets(cols, offs_d, stride_vn, stride_vd), mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # Causal: query i sees key j when j <= i + causal_offset; earlier query tiles see none of this tile.
    lo = 0
    if CAUSAL:
        lo = (tl.maximum(pid_n * BLOCK_N - causal_offset, 0) // BLOCK_M) * BLOCK_M
    for g in range(group):  # every q head that reads this k/v head adds to its gradients
        h = h_kv * group + g
        q_head = q_ptr + head_offset(b, h, stride_qb, stride_qh)
        do_head = do_ptr + head_offset(b, h, stride_dob, stride_doh)
        row_stats = (b * n_heads + h).to(tl.int64) * n_q
        for start_m in range(lo, n_q, BLOCK_M):
            rows = start_m + offs_m
            mask = (rows[:, None] < n_q) & (offs_d[None, :] < head_dim)
            q = tl.load(q_head + tile_offsets(rows, offs_d, stride_qn, stride_qd), mask=mask, other=0.0)
            do = tl.load(do_head + tile_offsets(rows, offs_d, stride_don, stride_dod), mask=mask, other=0.0)
            lse = tl.load(lse_ptr + row_stats + rows, mask=rows < n_q, other=0.0)
            lse = tl.where(lse == float("-inf"), float("inf"), lse)  # a row that saw no key: P = 0
            delta = tl.load(delta_ptr + row_stats + rows, mask=rows < n_q, other=0.0)

            p = recompute_p(q, k, lse, rows, cols, n_q, n_kv, causal_offset, sm_scale, CAUSAL, DOT_PRECISION)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=DOT_PRECISION)     # dV = P^T dO
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)                   # dP = dO V^T
            ds = p * (dp - delta[:, None])                                                # dS = P * (dP - D)
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=DOT_PRECISION)      # dK = dS^T Q (x scale)

    offs = pid_bkv.to(tl.int64) * n_kv * head_dim + tile_offsets(cols, offs_d, head_dim, 1)
    tl.store(dk_ptr + offs, (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptr + offs, dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)


@triton.jit
def attn_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
                       stride_qb, stride_qh, stride_qn, stride_qd,
                       stride_kb, stride_kh, stride_kn, stride_kd,
                       stride_vb, stride_vh, stride_vn, stride_vd,
                       stride_dob, stride_doh, stride_don, stride_dod,
                       n_heads, group, n_q, n_kv, head_dim, causal_offset, sm_scale,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                       CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    sm_scale = tl.cast(sm_scale, tl.float32)  # fp64 from torch.compile: math in float32
    # One program per (query tile, batch * head). dq has q's (contiguous) shape.
    pid = tl.program_id(0)
    n_m_tiles = tl.cdiv(n_q, BLOCK_M)
    pid_m = pid % n_m_tiles
    pid_bh = pid // n_m_tiles
    b = pid_bh // n_heads
    h = pid_bh % n_heads
    h_kv = h // group
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < n_q) & (offs_d[None, :] < head_dim)
    q = tl.load(q_ptr + head_offset(b, h, stride_qb, stride_qh)
                + tile_offsets(rows, offs_d, stride_qn, stride_qd), mask=mask, other=0.0)
    do = tl.load(do_ptr + head_offset(b, h, stride_dob, stride_doh)
                 + tile_offsets(rows, offs_d, stride_don, stride_dod), mask=mask, other=0.0)
    lse = tl.load(lse_ptr + pid_bh.to(tl.int64) * n_q + rows, mask=rows < n_q, other=0.0)
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    delta = tl.load(delta_ptr + pid_bh.to(tl.int64) * n_q + rows, mask=rows < n_q, other=0.0)
    k_head = k_ptr + head_offset(b, h_kv, stride_kb, stride_kh)
    v_head = v_ptr + head_offset(b, h_kv, stride_vb, stride_vh)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    hi = n_kv
    if CAUSAL:
        hi = tl.minimum(n_kv, (pid_m + 1) * BLOCK_M + causal_offset)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_mask = (cols[:, None] < n_kv) & (offs_d[None, :] < head_dim)
        k = tl.load(k_head + tile_offsets(cols, offs_d, stride_kn, stride_kd), mask=kv_mask, other=0.0)
        v = tl.load(v_head + tile_offsets(cols, offs_d, stride_vn, stride_vd), mask=kv_mask, other=0.0)
        p = recompute_p(q, k, lse, rows, cols, n_q, n_kv, causal_offset, sm_scale, CAUSAL, DOT_PRECISION)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)  # dQ = dS K (times scale, below)

    tl.store(dq_ptr + pid_bh.to(tl.int64) * n_q * head_dim + tile_offsets(rows, offs_d, head_dim, 1),
             (dq * sm_scale).to(dq_ptr.dtype.element_ty), mask=mask)


def dot_precision(dtype: torch.dtype) -> str | None:
    """float32 inputs multiply in full precision ("ieee", as the tuned forward and torch.matmul do): TF32
    would round every product's inputs to a 10-bit mantissa. 16-bit inputs: Triton's default."""
    return "ieee" if dtype == torch.float32 else None


def check_backward_inputs(q, k, v, o, lse, do, causal):
    """The forward's checks, plus: o and do shaped and typed like q, lse float32 (B, H, N)."""
    validate(q, k, v, causal)
    for name, t in (("o", o), ("do", do)):
        if not isinstance(t, torch.Tensor) or t.shape != q.shape or t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} must be a tensor of q's shape {tuple(q.shape)}, dtype {q.dtype} and "
                             f"device, got {getattr(t, 'shape', type(t))} {getattr(t, 'dtype', '')}")
    if not isinstance(lse, torch.Tensor) or lse.shape != q.shape[:3] or lse.dtype != torch.float32:
        raise ValueError(f"lse must be the forward's float32 log-sum-exp of shape {tuple(q.shape[:3])}")
    if not lse.is_contiguous():
        raise ValueError("lse must be contiguous (as the forward returns it)")


def row_delta(o: torch.Tensor, do: torch.Tensor, block_m: int = 64) -> torch.Tensor:
    """delta = rowsum(dO * O), float32, shape (B, H, N): one launch of the preprocess kernel."""
    B, H, N, D = o.shape
    delta = torch.empty((B, H, N), dtype=torch.float32, device=o.device)
    attn_bwd_preprocess_kernel[(triton.cdiv(N, block_m) * B * H,)](
        o, do, delta, *o.stride(), *do.stride(), H, N, D, BLOCK_M=block_m, BLOCK_D=block_d(D))
    return delta


def flash_attention_backward_teaching(q, k, v, o, lse, do, causal=False, sm_scale=None,
                                      block_m: int | None = None, block_n: int = 16):
    """(dq, dk, dv) of attention from the forward's output ``o`` and log-sum-exp ``lse`` (v1).

    ``block_m`` defaults to 32 query rows, 16 when d > 128 (to fit a T4's 64 KiB of shared memory)."""
    check_backward_inputs(q, k, v, o, lse, do, causal)
    B, H, N, D = q.shape
    H_kv, n_kv = k.shape[1], k.shape[2]
    scale = D ** -0.5 if sm_scale is None else float(sm_scale)
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    BD = block_d(D)
    block_m = block_m or (16 if BD > 128 else 32)
    delta = row_delta(o, do, block_m)
    common = (*q.stride(), *k.stride(), *v.stride(), *do.stride(), H, H // H_kv, N, n_kv, D, n_kv - N, scale)
    flags = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=BD, CAUSAL=bool(causal),
                 DOT_PRECISION=dot_precision(q.dtype))
    attn_bwd_dkdv_kernel[(triton.cdiv(n_kv, block_n) * B * H_kv,)](q, k, v, do, lse, delta, dk, dv, *common, **flags)
    attn_bwd_dq_kernel[(triton.cdiv(N, block_m) * B * H,)](q, k, v, do, lse, delta, dq, *common, **flags)
    return dq, dk, dv


def attention_backward_ref(q, k, v, do, causal=False, sm_scale=None):
    """(dq, dk, dv) by torch autograd through :func:`attention_ref` (S, P, dP and dS all in memory)."""
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    with torch.enable_grad():
        o = attention_ref(q, k, v, causal=causal, sm_scale=sm_scale)
        return torch.autograd.grad(o, (q, k, v), do)
