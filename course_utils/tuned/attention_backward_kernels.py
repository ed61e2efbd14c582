"""The tuned FlashAttention backward's kernels (chapter 11): the dK/dV pass and the dQ pass, each a program's
tile loop and its kernel. :mod:`course_utils.tuned.attention_backward` plans, launches and re-exports them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..kernels.attention import head_offset, tile_offsets
from .attention import load_tile


@triton.jit
def attn_bwd_dkdv_tiles(dk, dv, k, v, q_head, do_head, lse_row, delta_row, dq_row, cols,
                        stride_qn, stride_qd, stride_don, stride_dod,
                        lo, hi, n_q, head_dim, causal_offset, qk_scale, dq_scale, q_row,
                        BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr,
                        EVEN_M: tl.constexpr, EVEN_D: tl.constexpr, ATOMIC_DQ: tl.constexpr,
                        NUM_STAGES: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr):
    """Query tiles [lo, hi) against one key tile, everything transposed: (keys x queries). TMA: q_head
    and do_head are descriptors of the flattened (rows, d) tensors, this head's rows from ``q_row``."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    for start_m in tl.range(lo, hi, BLOCK_M, num_stages=NUM_STAGES):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        rows = start_m + offs_m
        if TMA:
            qT = tl.trans(q_head.load([q_row + start_m, 0]))
        else:
            qT = load_tile(q_head, offs_d, rows, head_dim, n_q, stride_qd, stride_qn, not EVEN_D, not EVEN_M)
        if EVEN_M:
            lse = tl.load(lse_row + rows)
            delta = tl.load(delta_row + rows)
        else:
            lse = tl.load(lse_row + rows, mask=rows < n_q, other=0.0)
            delta = tl.load(delta_row + rows, mask=rows < n_q, other=0.0)
        lse = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)  # base 2; no key: P = 0
        pT = tl.math.exp2(tl.dot(k, qT, input_precision=PREC) * qk_scale - lse[None, :])
        if MASKED:
            pT = tl.where(cols[:, None] <= rows[None, :] + causal_offset, pT, 0.0)
        if TMA:
            do = do_head.load([q_row + start_m, 0])
        else:
            do = load_tile(do_head, rows, offs_d, n_q, head_dim, stride_don, stride_dod, not EVEN_M, not EVEN_D)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=PREC)  # dV += P^T dO
        dpT = tl.dot(v, tl.trans(do), input_precision=PREC)        # dP^T = V dO^T
        dsT = (pT * (dpT - delta[None, :])).to(qT.dtype)           # dS^T = P^T * (dP^T - D)
        dk = tl.dot(dsT, tl.trans(qT), dk, input_precision=PREC)   # dK += dS^T Q
        if ATOMIC_DQ:                                              # dQ += dS K, from every key tile
            dq = tl.dot(tl.trans(dsT), k, input_precision=PREC).to(tl.float32) * dq_scale
            tl.atomic_add(dq_row + tile_offsets(rows, offs_d, head_dim, 1), dq,
                          mask=(rows[:, None] < n_q) & (offs_d[None, :] < head_dim), sem="relaxed")
    return dk, dv


@triton.jit
def attn_bwd_dkdv_tuned_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, dq_ptr,
                               stride_qb, stride_qh, stride_qn, stride_qd,
                               stride_kb, stride_kh, stride_kn, stride_kd,
                               stride_vb, stride_vh, stride_vn, stride_vd,
                               stride_dob, stride_doh, stride_don, stride_dod,
                               n_heads, group, n_q, n_kv, head_dim, causal_offset, qk_scale, sm_scale,
                               stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                               CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
                               EVEN_D: tl.constexpr, ATOMIC_DQ: tl.constexpr, NUM_STAGES: tl.constexpr,
                               PREC: tl.constexpr, TMA: tl.constexpr = False):
    """TMA: q_ptr and do_ptr are descriptors of the flattened (B * H * N, d) q and dO (host-made)."""
    # fp64 from torch.compile: math in float32
    qk_scale, sm_scale = tl.cast(qk_scale, tl.float32), tl.cast(sm_scale, tl.float32)
    pid = tl.program_id(0)
    n_n_tiles = tl.cdiv(n_kv, BLOCK_N)
    pid_n = pid % n_n_tiles
    if CAUSAL:  # the key tiles with the most query tiles to visit first
        pid_n = n_n_tiles - 1 - pid_n
    pid_bkv = pid // n_n_tiles
    n_kv_heads = n_heads // group
    b = pid_bkv // n_kv_heads
    h_kv = pid_bkv % n_kv_heads
    start_n = pid_n * BLOCK_N
    cols = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k = load_tile(k_ptr + head_offset(b, h_kv, stride_kb, stride_kh), cols, offs_d, n_kv, head_dim,
                  stride_kn, stride_kd, not EVEN_N, not EVEN_D)
    v = load_tile(v_ptr + head_offset(b, h_kv, stride_vb, stride_vh), cols, offs_d, n_kv, head_dim,
                  stride_vn, stride_vd, not EVEN_N, not EVEN_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    # Causal: queries before `lo` see no key of this tile; from `full_lo` on they see all of them.
    lo = 0
    full_lo = 0
    if CAUSAL:
        lo = (tl.maximum(start_n - causal_offset, 0) // BLOCK_M) * BLOCK_M
        full_lo = tl.minimum(tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - causal_offset, 0), BLOCK_M) * BLOCK_M,
                             tl.cdiv(n_q, BLOCK_M) * BLOCK_M)
    for g in range(group):  # every q head of the group adds to this k/v head's gradients
        h = h_kv * group + g
        if TMA:  # descriptors take int32 coordinates: the launcher checks the rows fit
            q_head = q_ptr
            do_head = do_ptr
        else:
            q_head = q_ptr + head_offset(b, h, stride_qb, stride_qh)
            do_head = do_ptr + head_offset(b, h, stride_dob, stride_doh)
        q_row = (b * n_heads + h) * n_q
        row = (b * n_heads + h).to(tl.int64) * n_q
        dq_row = dq_ptr + row * head_dim
        if CAUSAL:
            dk, dv = attn_bwd_dkdv_tiles(dk, dv, k, v, q_head, do_head, lse_ptr + row, delta_ptr + row, dq_row,
                                         cols, stride_qn, stride_qd, stride_don, stride_dod,
                                         lo, full_lo, n_q, head_dim, causal_offset, qk_scale, sm_scale, q_row,
                                         BLOCK_M, BLOCK_D, True, False, EVEN_D, ATOMIC_DQ, NUM_STAGES, PREC, TMA)
        dk, dv = attn_bwd_dkdv_tiles(dk, dv, k, v, q_head, do_head, lse_ptr + row, delta_ptr + row, dq_row,
                                     cols, stride_qn, stride_qd, stride_don, stride_dod,
                                     full_lo, n_q, n_q, head_dim, causal_offset, qk_scale, sm_scale, q_row,
                                     BLOCK_M, BLOCK_D, False, EVEN_M, EVEN_D, ATOMIC_DQ, NUM_STAGES, PREC, TMA)
    # dK and dV by their own strides (unit stride along d): straight into a packed dQKV buffer, no gather after
    mask = (cols[:, None] < n_kv) & (offs_d[None, :] < head_dim)
    dk_offs = head_offset(b, h_kv, stride_dkb, stride_dkh) + tile_offsets(cols, offs_d, stride_dkn, 1)
    dv_offs = head_offset(b, h_kv, stride_dvb, stride_dvh) + tile_offsets(cols, offs_d, stride_dvn, 1)
    tl.store(dk_ptr + dk_offs, (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=mask)
    tl.store(dv_ptr + dv_offs, dv.to(dv_ptr.dtype.element_ty), mask=mask)


@triton.jit
def attn_bwd_dq_tiles(dq, q, do, lse, delta, k_head, v_head, rows,
                      stride_kn, stride_kd, stride_vn, stride_vd,
                      lo, hi, n_kv, head_dim, causal_offset, qk_scale, kv_row,
                      BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr,
                      EVEN_N: tl.constexpr, EVEN_D: tl.constexpr, NUM_STAGES: tl.constexpr, PREC: tl.constexpr,
                      TMA: tl.constexpr):
    """Key tiles [lo, hi) against one query tile. TMA: k_head and v_head are descriptors of the
    flattened (rows, d) tensors, this head's rows from ``kv_row``."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    for start_n in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        if TMA:
            kT = tl.trans(k_head.load([kv_row + start_n, 0]))
            vT = tl.trans(v_head.load([kv_row + start_n, 0]))
        else:
            kT = load_tile(k_head, offs_d, cols, head_dim, n_kv, stride_kd, stride_kn, not EVEN_D, not EVEN_N)
            vT = load_tile(v_head, offs_d, cols, head_dim, n_kv, stride_vd, stride_vn, not EVEN_D, not EVEN_N)
        p = tl.math.exp2(tl.dot(q, kT, input_precision=PREC) * qk_scale - lse[:, None])
        if MASKED:
            p = tl.where(cols[None, :] <= rows[:, None] + causal_offset, p, 0.0)
        dp = tl.dot(do, vT, input_precision=PREC)
        ds = (p * (dp - delta[:, None])).to(kT.dtype)
        dq = tl.dot(ds, tl.trans(kT), dq, input_precision=PREC)
    return dq


@triton.jit
def attn_bwd_dq_tuned_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
                             stride_qb, stride_qh, stride_qn, stride_qd,
                             stride_kb, stride_kh, stride_kn, stride_kd,
                             stride_vb, stride_vh, stride_vn, stride_vd,
                             stride_dob, stride_doh, stride_don, stride_dod,
                             n_heads, group, n_q, n_kv, head_dim, causal_offset, qk_scale, sm_scale,
                             stride_dqb, stride_dqh, stride_dqn,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                             CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
                             EVEN_D: tl.constexpr, NUM_STAGES: tl.constexpr, PREC: tl.constexpr,
                             TMA: tl.constexpr = False):
    """TMA: k_ptr and v_ptr are descriptors of the flattened (B * H_kv * N_kv, d) k and v (host-made)."""
    # fp64 from torch.compile: math in float32
    qk_scale, sm_scale = tl.cast(qk_scale, tl.float32), tl.cast(sm_scale, tl.float32)
    pid = tl.program_id(0)
    n_m_tiles = tl.cdiv(n_q, BLOCK_M)
    pid_m = pid % n_m_tiles
    if CAUSAL:
        pid_m = n_m_tiles - 1 - pid_m
    pid_bh = pid // n_m_tiles
    b = pid_bh // n_heads
    h = pid_bh % n_heads
    h_kv = h // group
    start_m = pid_m * BLOCK_M
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = load_tile(q_ptr + head_offset(b, h, stride_qb, stride_qh), rows, offs_d, n_q, head_dim,
                  stride_qn, stride_qd, not EVEN_M, not EVEN_D)
    do = load_tile(do_ptr + head_offset(b, h, stride_dob, stride_doh), rows, offs_d, n_q, head_dim,
                   stride_don, stride_dod, not EVEN_M, not EVEN_D)
    row = pid_bh.to(tl.int64) * n_q
    lse = tl.load(lse_ptr + row + rows, mask=rows < n_q, other=0.0)
    lse = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(delta_ptr + row + rows, mask=rows < n_q, other=0.0)
    if TMA:
        k_head = k_ptr
        v_head = v_ptr
    else:
        k_head = k_ptr + head_offset(b, h_kv, stride_kb, stride_kh)
        v_head = v_ptr + head_offset(b, h_kv, stride_vb, stride_vh)
    kv_row = (b * (n_heads // group) + h_kv) * n_kv
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    full_hi = n_kv
    if CAUSAL:  # keys every row of this tile sees, then the diagonal tiles with the mask
        full_hi = tl.minimum(tl.maximum(((start_m + causal_offset + 1) // BLOCK_N) * BLOCK_N, 0),
                             (n_kv // BLOCK_N) * BLOCK_N)
    dq = attn_bwd_dq_tiles(dq, q, do, lse, delta, k_head, v_head, rows, stride_kn, stride_kd, stride_vn,
                           stride_vd, 0, full_hi, n_kv, head_dim, causal_offset, qk_scale, kv_row,
                           BLOCK_N, BLOCK_D, False, EVEN_N or CAUSAL, EVEN_D, NUM_STAGES, PREC, TMA)
    if CAUSAL:
        hi = tl.minimum(start_m + BLOCK_M + causal_offset, n_kv)
        dq = attn_bwd_dq_tiles(dq, q, do, lse, delta, k_head, v_head, rows, stride_kn, stride_kd, stride_vn,
                               stride_vd, full_hi, hi, n_kv, head_dim, causal_offset, qk_scale, kv_row,
                               BLOCK_N, BLOCK_D, True, False, EVEN_D, NUM_STAGES, PREC, TMA)
    tl.store(dq_ptr + head_offset(b, h, stride_dqb, stride_dqh) + tile_offsets(rows, offs_d, stride_dqn, 1),
             (dq * sm_scale).to(dq_ptr.dtype.element_ty),
             mask=(rows[:, None] < n_q) & (offs_d[None, :] < head_dim))
