"""FlashAttention backward, the tuned shelf (v2 of ``kernels.attention_backward``), and the autograd
Function pairing it with the tuned forward. (Over 350 lines: two kernels and their tile loops, the
tiles per device, the launcher, the autograd Function and the compile cases belong together.)

v1's kernels in base 2, the causal mask only on diagonal tiles (ragged edges: zero-filled loads),
the dK/dV products computed transposed (K Q^T, V dO^T), software pipelining, tiles per device,
IEEE dots for float32. dQ has its own pass; ``BwdConfig.atomic_dq`` adds dS K from the dK/dV
programs into a float32 buffer with atomics instead. On an H100 (results/h100-80gb-hbm3/
attention_bwd_tiles.csv, 64 x 128 tiles both ways) atomics lost 6 of 8 cases (up to 9%), tied one
and won one by 3%; with 32-row query tiles they were up to 1.6x slower. The own pass redoes Q K^T
and dO V^T per tile but writes dQ once: no float32 scratch, and run-to-run identical gradients for
a fixed tile configuration (``config=``; unpinned, the fastest is chosen by timing, per process).
``BwdConfig.tma`` loads the streamed tiles (q and dO in the dK/dV pass, k and v in the dQ pass) through
tensor descriptors made on the host, where the inputs allow it (contiguous, whole tiles, d a power of two).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import env, hardware
from ..kernels.attention import LOG2E, block_d, head_offset, tile_offsets
from ..kernels.attention_backward import (
    attn_bwd_preprocess_kernel,
    check_backward_inputs,
    dot_precision,
    row_delta,  # noqa: F401  (importable from here, as before)
)
from .attention import choose, flash_attention, load_tile, tma_ok
from .launch import aligned16, launch, traced


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


@dataclass(frozen=True)
class BwdConfig:
    block_m1: int  # dK/dV pass: query rows per step ...
    block_n1: int  # ... against this many keys held by one program
    block_m2: int  # dQ pass: query rows held by one program ...
    block_n2: int  # ... against this many keys per step
    num_warps: int = 4
    num_stages: int = 3
    atomic_dq: bool = False  # dQ by atomic adds from the dK/dV pass instead of its own pass
    tma: bool = False  # streamed tiles (q, dO; k, v) by tensor descriptors (sm_90), where the inputs allow it

    def smem_bytes(self, head_dim: int, itemsize: int) -> int:
        """Shared memory of the larger pass: two streamed tiles per stage plus the held pair."""
        d = block_d(head_dim) * itemsize
        one = (2 * self.block_m1 * max(self.num_stages - 1, 1) + 2 * self.block_n1) * d
        two = (2 * self.block_n2 * max(self.num_stages - 1, 1) + 2 * self.block_m2) * d
        return max(one, two)


# Best first, from the H100 tile sweep (results/h100-80gb-hbm3/attention_bwd_tiles.csv): d=64, three within
# 5%; d=128, 64 x 128 dK/dV tiles on two warpgroups beat the Triton tutorial's 32 x 128 on one by 1.9-2.1x;
# 8 warps, 4 stages came after the sweep (the timed choice took it for 3 of 4 d=128 shapes of attention.csv).
# The last two d=128 candidates are timed, kept only where faster: atomic dQ on the 64 x 128 tiles (ahead of
# the separate pass non-causal in tools/gpu_checks/attention_backward.py on an H100, 4.6 vs 4.8 ms at N=4096,
# behind causal), and the first tiles with the streamed q/dO and k/v tiles by tensor descriptors (TMA: the
# forward's descriptors gained 2-4% over pointers in attention_tiles_explore.csv; no address registers).
_HOPPER_BWD = {
    64: [BwdConfig(32, 128, 128, 32, 4, 3), BwdConfig(32, 64, 64, 32, 4, 4), BwdConfig(64, 64, 64, 64, 4, 3)],
    128: [BwdConfig(64, 128, 128, 64, 8, 3), BwdConfig(64, 128, 128, 64, 8, 4), BwdConfig(32, 64, 64, 32, 4, 4),
          BwdConfig(64, 128, 128, 64, 8, 3, True), BwdConfig(64, 128, 128, 64, 8, 3, tma=True)],
    256: [BwdConfig(32, 64, 64, 32, 4, 2), BwdConfig(16, 64, 64, 16, 4, 2)],
}
# T4 (64 KiB): what the sm_75 compile matrix fits (smem_bytes misses its conversion scratch).
_SMALL_BWD = {64: [BwdConfig(32, 64, 64, 32, 4, 2)], 128: [BwdConfig(16, 32, 32, 16, 4, 2)],
              256: [BwdConfig(16, 16, 16, 16, 4, 1)]}
_OTHER_BWD = [BwdConfig(32, 64, 64, 32, 4, 2), BwdConfig(16, 64, 64, 16, 4, 2), BwdConfig(16, 32, 32, 16, 4, 1)]
INTERPRETER_BWD = BwdConfig(16, 32, 32, 16, 4, 1)
SMALLEST_BWD = _SMALL_BWD[256][0]  # when nothing fits by the estimate (fp32, d=256 on 64 KiB)


def backward_configs(info: hardware.DeviceInfo, head_dim: int, dtype: torch.dtype) -> list[BwdConfig]:
    """The backward tile configurations tried on ``info`` (those that fit its shared memory)."""
    if info == hardware.INTERPRETER_DEVICE:
        return [INTERPRETER_BWD]
    itemsize = torch.empty((), dtype=dtype).element_size()
    bd = block_d(head_dim)
    if info.arch >= 90 and itemsize == 2:
        cands = _HOPPER_BWD[max(64, bd)]
    elif info.smem_per_block_bytes < 100 * 1024 and itemsize == 2:
        cands = _SMALL_BWD[max(64, bd)]
    else:
        cands = _OTHER_BWD
    fits = [c for c in cands if c.smem_bytes(head_dim, itemsize) <= int(info.smem_per_block_bytes * 0.95)]
    return fits or [SMALLEST_BWD]


last_config: BwdConfig | None = None


def _use_tma(cfg: BwdConfig, q, k, v, do) -> bool:
    """Descriptors of the flattened (rows, d) tensors: contiguous, 16-byte aligned, d a power of two (no
    padded columns), int32 row coordinates, and every streamed tile inside one head (whole tiles)."""
    B, H, N, D = q.shape
    n_kv = k.shape[2]
    hopper = not env.on_gpu() or hardware.device_info().arch >= 90  # (the interpreter runs descriptors too)
    return (cfg.tma and hopper and D == block_d(D) and all(t.is_contiguous() for t in (q, k, v, do))
            and tma_ok(q, k, v, do) and max(q.numel(), k.numel()) // D < 2**31
            and N % cfg.block_m1 == 0 and N % cfg.block_m2 == 0
            and n_kv % cfg.block_n1 == 0 and n_kv % cfg.block_n2 == 0)


def _launch(cfg: BwdConfig, q, k, v, do, lse, delta, dq, dk, dv, scale, causal):
    B, H, N, D = q.shape
    H_kv, n_kv = k.shape[1], k.shape[2]
    tma, grid_kv, meta_kv, grid_q, meta_q = _launch_plan(cfg, q, k, v, do, causal)
    q_in, do_in, k_in, v_in = q, do, k, v
    if tma:
        BD = meta_kv["BLOCK_D"]
        q_in, do_in = (TensorDescriptor.from_tensor(t.view(-1, D), [cfg.block_m1, BD]) for t in (q, do))
        k_in, v_in = (TensorDescriptor.from_tensor(t.view(-1, D), [cfg.block_n2, BD]) for t in (k, v))
    common = (*q.stride(), *k.stride(), *v.stride(), *do.stride(), H, H // H_kv, N, n_kv, D, n_kv - N,
              scale * LOG2E, scale)
    dq_buf = dq
    if cfg.atomic_dq:   # a contiguous float32 scratch for the atomics, copied into dq (of any strides) after
        dq_buf = torch.zeros(dq.shape, dtype=torch.float32, device=dq.device)
    launch(attn_bwd_dkdv_tuned_kernel, "attn_bwd_dkdv", grid_kv,
           (q_in, k, v, do_in, lse, delta, dk, dv, dq_buf, *common, *dk.stride()[:3], *dv.stride()[:3]), meta_kv)
    if cfg.atomic_dq:
        dq.copy_(dq_buf)
    else:
        launch(attn_bwd_dq_tuned_kernel, "attn_bwd_dq", grid_q,
               (q, k_in, v_in, do, lse, delta, dq, *common, *dq.stride()[:3]), meta_q)


_LAUNCH_PLANS: dict = {}   # what _launch works out per (tiles, shapes, strides, dtype, alignment): host time


def _launch_plan(cfg: BwdConfig, q, k, v, do, causal):
    """(descriptors or not, then grid and constexprs/options of the dK/dV and the dQ launch): a pure function
    of the tiles, the shapes, strides, dtype and device of q, k, v, do, whether their pointers are 16-byte
    aligned, and causal."""
    key = (cfg, q.shape, k.shape, q.stride(), k.stride(), v.stride(), do.stride(), q.dtype, q.device, bool(causal),
           aligned16(q), aligned16(k), aligned16(v), aligned16(do), traced(q))
    plan = _LAUNCH_PLANS.get(key)
    if plan is None:
        B, H, N, D = q.shape
        H_kv, n_kv = k.shape[1], k.shape[2]
        BD = block_d(D)
        tma = _use_tma(cfg, q, k, v, do)
        flags = dict(CAUSAL=bool(causal), EVEN_D=D == BD, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                     NUM_STAGES=cfg.num_stages, PREC=dot_precision(q.dtype))
        meta_kv = dict(BLOCK_M=cfg.block_m1, BLOCK_N=cfg.block_n1, BLOCK_D=BD, EVEN_M=N % cfg.block_m1 == 0,
                       EVEN_N=n_kv % cfg.block_n1 == 0, ATOMIC_DQ=cfg.atomic_dq, TMA=tma, **flags)
        meta_q = dict(BLOCK_M=cfg.block_m2, BLOCK_N=cfg.block_n2, BLOCK_D=BD, EVEN_M=N % cfg.block_m2 == 0,
                      EVEN_N=n_kv % cfg.block_n2 == 0, TMA=tma, **flags)
        plan = _LAUNCH_PLANS[key] = (tma, (-(-n_kv // cfg.block_n1) * B * H_kv,), meta_kv,
                                     (-(-N // cfg.block_m2) * B * H,), meta_q)
    return plan


def _block_d(head_dim: int) -> int:
    """``block_d`` in plain integers (``triton.next_power_of_2`` is a constexpr function: microseconds a call)."""
    return max(16, 1 << (head_dim - 1).bit_length())


def delta_rows(o: torch.Tensor, do: torch.Tensor, block_m: int = 64) -> torch.Tensor:
    """``row_delta`` of the teaching module (delta = rowsum(dO * O), float32, (B, H, N)), the same kernel and
    arguments, through the ops' cheaper launch (:mod:`.launch`)."""
    B, H, N, D = o.shape
    delta = torch.empty((B, H, N), dtype=torch.float32, device=o.device)
    launch(attn_bwd_preprocess_kernel, "attn_bwd_delta", (-(-N // block_m) * B * H,),
           (o, do, delta, *o.stride(), *do.stride(), H, N, D), dict(BLOCK_M=block_m, BLOCK_D=_block_d(D)))
    return delta


def flash_attention_backward(q, k, v, o, lse, do, causal=False, sm_scale=None, config: BwdConfig | None = None):
    """(dq, dk, dv) from the forward's output ``o`` and log-sum-exp ``lse`` (v2, tuned). Grouped-query:
    dk, dv summed over each group's q heads in the dK/dV program. ``config`` pins the tiles; otherwise the
    fastest of :func:`backward_configs` is timed once per shape and process on a GPU."""
    check_backward_inputs(q, k, v, o, lse, do, causal)
    B, H, N, D = q.shape
    scale = D ** -0.5 if sm_scale is None else float(sm_scale)
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    delta = delta_rows(o, do)
    if config is None:
        cands = backward_configs(hardware.device_info(), D, q.dtype)
        key = ("bwd", torch.cuda.current_device() if env.on_gpu() else -1, q.shape, k.shape, q.dtype, bool(causal))
        config = choose(cands, key, lambda c: _launch(c, q, k, v, do, lse, delta, dq, dk, dv, scale, causal))
    _launch(config, q, k, v, do, lse, delta, dq, dk, dv, scale, causal)
    global last_config
    last_config = config
    return dq, dk, dv


class FlashAttentionFunction(torch.autograd.Function):
    """softmax(q k^T * scale [+ causal]) v with the tuned forward and backward kernels.

    Saves q, k, v, o and the float32 log-sum-exp (B, H, N): nothing N x N."""

    @staticmethod
    def forward(ctx, q, k, v, causal=False, sm_scale=None, config=None):
        o, lse = flash_attention(q, k, v, causal=causal, sm_scale=sm_scale, return_lse=True)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.sm_scale, ctx.config = causal, sm_scale, config
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        if do.dtype != q.dtype:
            raise TypeError(f"the output gradient must have the output's dtype {q.dtype}, got {do.dtype}")
        dq, dk, dv = flash_attention_backward(q, k, v, o, lse, do, ctx.causal, ctx.sm_scale, ctx.config)
        return dq, dk, dv, None, None, None


def flash_attention_autograd(q, k, v, causal=False, sm_scale=None, config: BwdConfig | None = None):
    """Differentiable FlashAttention: q (B, H, N, d), k/v (B, H_kv, N_kv, d), H a multiple of H_kv,
    d <= 256, float16/bfloat16/float32; causal aligned bottom-right when N_kv != N. ``config`` pins the
    backward's tiles (bit-identical gradients across processes on one GPU; unpinned, the fastest is
    timed once per shape and process, and ``last_config`` says which ran)."""
    return FlashAttentionFunction.apply(q, k, v, bool(causal), sm_scale, config)


def compile_cases(info):
    """The compile matrix's launches (course_utils/aot.py): tiles, both dQ ways, masks, padded d, GQA, 2^31+."""
    from ..aot import dtype_name, dtypes_for, empty
    from ..kernels.attention_backward import flash_attention_backward_teaching

    def args(d, dt, heads=2, kv_heads=2, n=256):
        q, o, do = (empty(1, heads, n, d, dtype=dt) for _ in range(3))
        k, v = (empty(1, kv_heads, n, d, dtype=dt) for _ in range(2))
        return q, k, v, o, empty(1, heads, n, dtype=torch.float32), do

    for dt in dtypes_for(info):
        n = dtype_name(dt)
        first = {d: backward_configs(info, d, dt)[0] for d in (64, 80, 128)}
        cases = [(d, c, first[d]) for d in (64, 128) for c in (False, True)] + [(80, True, first[80])]
        cases += [(128, False, c) for c in backward_configs(info, 128, dt)[1:]]  # every tile it may pick
        cases += [(128, True, BwdConfig(**{**first[128].__dict__, "atomic_dq": True}))]
        for d, causal, c in cases:
            yield (f"flash_attention_backward {n} d={d} causal={causal} {c}",
                   lambda d=d, dt=dt, k=causal, c=c: flash_attention_backward(*args(d, dt, 4, 2), k, config=c))
        for d in (64, 80):
            yield (f"flash_attention_backward_teaching {n} d={d}",
                   lambda d=d, dt=dt: flash_attention_backward_teaching(*args(d, dt, 4, 2), True))
    big = (2**17 + 64, 2**17 + 64, 64)
    dt = torch.float16
    cfg = backward_configs(info, 256, dt)[0]
    yield "flash_attention_backward 2^31+ elements", lambda: flash_attention_backward(*args(256, dt, *big), True,
                                                                                      config=cfg)
    yield ("flash_attention_backward_teaching 2^31+ elements",
           lambda: flash_attention_backward_teaching(*args(256, dt, *big), True))
