"""FlashAttention forward, the tuned shelf (v2 of ``course_utils.kernels.attention``).
(Over 350 lines: the kernel, its three load paths, the per-device tiles and the timed choice that
the backward shares belong together; the compile cases are the last 25 lines.)

v1 in base 2 (the scale folded into log2 e), masks only on the ragged or diagonal tiles, causal
tiles above the diagonal never visited, software pipelining (``tl.range(num_stages=)``), tiles chosen
per device (:func:`attention_configs`) and timed once per shape; on sm_90 the candidates include
tensor-descriptor (TMA copy engine) loads. Same contract as the teaching kernel: any head dim up to
256, grouped-query heads, causal aligned bottom-right.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import env, hardware
from ..kernels.attention import DTYPES, LOG2E, MAX_HEAD_DIM, block_d, head_offset, prepare, tile_offsets
from . import choice
from .choice import CHOICE_ROUNDS  # noqa: F401  (course_utils.kernels.attention forwards it)
from .launch import aligned16, launch, traced


@triton.jit
def load_tile(base, rows, cols, n_rows, n_cols, row_stride, col_stride,
              CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    """A (rows x cols) tile, zero outside ``n_rows x n_cols``; masks only where asked for."""
    ptrs = base + tile_offsets(rows, cols, row_stride, col_stride)
    if CHECK_ROWS and CHECK_COLS:
        return tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0)
    elif CHECK_ROWS:
        return tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
    elif CHECK_COLS:
        return tl.load(ptrs, mask=cols[None, :] < n_cols, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def attn_fwd_tuned_tiles(acc, l_i, m_i, q, k_src, v_src, kv_row,
                         stride_kn, stride_kd, stride_vn, stride_vd,
                         lo, hi, offs_m, offs_n, offs_d, n_kv, head_dim, causal_offset, qk_scale,
                         BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                         TMA: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
                         NUM_STAGES: tl.constexpr):
    """Key/value tiles [lo, hi), unmasked or (MASKED) with the ragged/causal mask; k_src/v_src are
    pointers (TMA=0) or descriptors (rows from ``kv_row``; they zero-fill the padded head dim)."""
    for start_n in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        if TMA > 0:
            k = k_src.load([kv_row + start_n, 0])
        else:
            k = load_tile(k_src, cols, offs_d, n_kv, head_dim, stride_kn, stride_kd, MASKED, not EVEN_D)
        s = tl.dot(q, k.T, input_precision=DOT_PRECISION)
        if MASKED:
            keep = cols[None, :] < n_kv
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None] + causal_offset)
            s = s * qk_scale + tl.where(keep, 0.0, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: 0, not NaN
            s = s - m_use[:, None]
            alpha = tl.math.exp2(m_i - m_use)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            s = s * qk_scale - m_new[:, None]
            alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if TMA > 0:
            v = v_src.load([kv_row + start_n, 0])
        else:
            v = load_tile(v_src, cols, offs_d, n_kv, head_dim, stride_vn, stride_vd, MASKED, not EVEN_D)
        if MASKED and TMA == 2:  # rows past this head's end belong to the next head: zero them
            v = tl.where(cols[:, None] < n_kv, v, 0.0)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def attn_fwd_tuned_kernel(q_src, k_src, v_src, o_ptr, lse_ptr,
                          stride_qb, stride_qh, stride_qn, stride_qd,
                          stride_kb, stride_kh, stride_kn, stride_kd,
                          stride_vb, stride_vh, stride_vn, stride_vd,
                          stride_ob, stride_oh, stride_on, stride_od,
                          n_heads, group, n_q, n_kv, head_dim, causal_offset, qk_scale, q_scale,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                          CAUSAL: tl.constexpr, STORE_LSE: tl.constexpr, TMA: tl.constexpr,
                          DOT_PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr, Q_REGS: tl.constexpr,
                          EVEN_D: tl.constexpr):
    """TMA=0: pointers; 1: descriptors per head, made on the device; 2: made on the host (flattened)."""
    # fp64 from torch.compile: math in float32
    qk_scale, q_scale = tl.cast(qk_scale, tl.float32), tl.cast(q_scale, tl.float32)
    pid = tl.program_id(0)
    n_m_tiles = tl.cdiv(n_q, BLOCK_M)
    pid_m = pid % n_m_tiles
    if CAUSAL:  # the longest rows (bottom of the triangle) first: a better-balanced last wave
        pid_m = n_m_tiles - 1 - pid_m
    pid_bh = pid // n_m_tiles
    b = pid_bh // n_heads
    h = pid_bh % n_heads
    h_kv = h // group
    o_ptr += head_offset(b, h, stride_ob, stride_oh)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    kv_row = 0
    if TMA == 2:
        kv_row = (b * (n_heads // group) + h_kv) * n_kv
        k_in = k_src
        v_in = v_src
        q = q_src.load([pid_bh * n_q + start_m, 0])
    elif TMA == 1:  # one descriptor per head: the copy engine zero-fills rows and columns past the end
        q = tl.make_tensor_descriptor(q_src + head_offset(b, h, stride_qb, stride_qh), shape=[n_q, head_dim],
                                      strides=[stride_qn, 1], block_shape=[BLOCK_M, BLOCK_D]).load([start_m, 0])
        k_in = tl.make_tensor_descriptor(k_src + head_offset(b, h_kv, stride_kb, stride_kh), shape=[n_kv, head_dim],
                                         strides=[stride_kn, 1], block_shape=[BLOCK_N, BLOCK_D])
        v_in = tl.make_tensor_descriptor(v_src + head_offset(b, h_kv, stride_vb, stride_vh), shape=[n_kv, head_dim],
                                         strides=[stride_vn, 1], block_shape=[BLOCK_N, BLOCK_D])
    else:
        k_in = k_src + head_offset(b, h_kv, stride_kb, stride_kh)
        v_in = v_src + head_offset(b, h_kv, stride_vb, stride_vh)
        q = load_tile(q_src + head_offset(b, h, stride_qb, stride_qh), offs_m, offs_d, n_q, head_dim,
                      stride_qn, stride_qd, True, not EVEN_D)

    if Q_REGS:  # q times the scale's power of two (exact): q, computed, stays in registers for Q K^T
        q = (q * q_scale).to(q.dtype)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Stage 1: key tiles every query row of this tile sees whole -- no mask at all.
    full_hi = (n_kv // BLOCK_N) * BLOCK_N
    hi = n_kv
    if CAUSAL:  # row start_m sees keys j <= start_m + causal_offset, and so does every later row
        full_hi = tl.minimum(tl.maximum(((start_m + causal_offset + 1) // BLOCK_N) * BLOCK_N, 0), full_hi)
        hi = tl.minimum(start_m + BLOCK_M + causal_offset, n_kv)
    acc, l_i, m_i = attn_fwd_tuned_tiles(acc, l_i, m_i, q, k_in, v_in, kv_row, stride_kn, stride_kd, stride_vn,
                                         stride_vd, 0, full_hi, offs_m, offs_n, offs_d, n_kv, head_dim, causal_offset,
                                         qk_scale, BLOCK_N, False, CAUSAL, TMA, EVEN_D, DOT_PRECISION, NUM_STAGES)
    # Stage 2: the diagonal tiles (causal) or the ragged last tile -- masked.
    acc, l_i, m_i = attn_fwd_tuned_tiles(acc, l_i, m_i, q, k_in, v_in, kv_row, stride_kn, stride_kd, stride_vn,
                                         stride_vd, full_hi, hi, offs_m, offs_n, offs_d, n_kv, head_dim, causal_offset,
                                         qk_scale, BLOCK_N, True, CAUSAL, TMA, EVEN_D, DOT_PRECISION, NUM_STAGES)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # a row that saw no key: 0
    o_mask = (offs_m[:, None] < n_q) & (offs_d[None, :] < head_dim)
    tl.store(o_ptr + tile_offsets(offs_m, offs_d, stride_on, stride_od), out.to(o_ptr.dtype.element_ty),
             mask=o_mask)
    if STORE_LSE:  # back to natural log: lse = ln2 * (m + log2 l)
        tl.store(lse_ptr + pid_bh.to(tl.int64) * n_q + offs_m,
                 (m_i + tl.math.log2(l_i)) * 0.6931471805599453, mask=offs_m < n_q)


# Tile choice: a pure function of the device, so a T4/A100/H100 answer is known without the GPU
@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: int = 0  # 0 pointers, 1 tensor descriptors made on the device, 2 made on the host
    q_regs: bool = False  # fold the power-of-two part of the scale into q (q then sits in registers)

    @property
    def use_tma(self) -> bool:
        return self.tma > 0

    def smem_bytes(self, head_dim: int, itemsize: int) -> int:
        """Shared memory the tiles need: Q once, K and V once per tile in flight (num_stages - 1)."""
        return (self.block_m + 2 * max(self.num_stages - 1, 1) * self.block_n) * block_d(head_dim) * itemsize


# Candidates, best first. Hopper, d <= 128: tile sweeps on an H100 and an H200 (bf16, N = 4096;
# results/*/attention_tiles_explore.csv, results/h200/attention_configs.csv, .../attention_qregs_explore.csv):
# 64-row query tiles, one warpgroup, three stages fit two programs on an SM, one's softmax overlapping the
# other's matrix products; q_regs won 1.4-4.1% in 7 of 8 comparisons at d=128 on an H100. d=256 and the
# other GPUs follow from shared memory (A100 163 KiB, T4 or consumer GPUs 64-99 KiB), not measurements.
_HOPPER = {
    64: [TileConfig(64, 128, 4, 3, 2), TileConfig(64, 64, 4, 3, 2)],
    128: [TileConfig(64, 64, 4, 3, 2, True), TileConfig(64, 64, 4, 3, 2)],
    256: [TileConfig(64, 32, 4, 3, 2), TileConfig(64, 64, 8, 2, 2)],
}
_AMPERE = [TileConfig(128, 64, 4, 3), TileConfig(128, 64, 8, 3), TileConfig(128, 32, 4, 3),
           TileConfig(64, 64, 4, 3), TileConfig(64, 32, 4, 2)]
_SMALL = [TileConfig(64, 64, 4, 2), TileConfig(64, 32, 4, 2), TileConfig(32, 32, 4, 2),
          TileConfig(32, 16, 4, 1)]
INTERPRETER_TILES = TileConfig(32, 16, 4, 1)


def attention_configs(info: hardware.DeviceInfo, head_dim: int, dtype: torch.dtype,
                      causal: bool = False, max_configs: int = 4) -> list[TileConfig]:
    """The tiles the launcher tries on ``info``, best guess first: those that fit its shared memory,
    TMA only on sm_90, one small tile under the interpreter (tiny tests still cross several tiles)."""
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be between 1 and {MAX_HEAD_DIM}, got {head_dim}")
    if dtype not in DTYPES:
        raise TypeError(f"dtype must be one of {DTYPES}, got {dtype}")
    if info == hardware.INTERPRETER_DEVICE:
        return [INTERPRETER_TILES]
    itemsize = torch.empty((), dtype=dtype).element_size()
    if info.arch >= 90 and itemsize == 2:
        cands = _HOPPER[64 if block_d(head_dim) <= 64 else block_d(head_dim) if head_dim > 128 else 128]
    elif info.arch >= 80 and info.smem_per_block_bytes >= 160 * 1024:
        cands = _AMPERE
    else:
        cands = _SMALL
    if info.arch < 90:
        cands = [TileConfig(c.block_m, c.block_n, c.num_warps, c.num_stages, 0) for c in cands]
    if itemsize == 4:  # fp32 tiles hold twice the bytes and have no fast tensor-core path
        cands = [TileConfig(c.block_m // 2 if c.block_m > 32 else c.block_m, min(c.block_n, 32), 4,
                            min(c.num_stages, 2), c.tma) for c in cands]
    budget = int(info.smem_per_block_bytes * 0.95)
    fits = list(dict.fromkeys(c for c in cands if c.smem_bytes(head_dim, itemsize) <= budget))
    return fits[:max_configs] or [TileConfig(32, 16, 4, 1)]


# Launcher
last_config: TileConfig | None = None  # what the last flash_attention call ran (benchmarks record it)
_BEST: dict = {}  # (device, shape class, dtype, causal) -> TileConfig, filled by timing on the GPU


def tma_ok(*ts) -> bool:
    """Tensor descriptors need a unit last stride and 16-byte aligned base and other strides. While
    torch.compile traces, none: Inductor's build of the descriptor kernels failed (torch 2.11, an H100), so
    its graph launches the pointer tiles."""
    return not any(traced(t) for t in ts) and all(t.stride(-1) == 1 and aligned16(t)
               and all((s * t.element_size()) % 16 == 0 for s in t.stride()[:-1]) for t in ts)


def _tma_mode(cfg: TileConfig, q, k, v) -> int:
    """The descriptor mode the inputs allow: host descriptors need contiguous inputs and int32 rows."""
    rows_fit = max(q.shape[0] * q.shape[1] * q.shape[2], k.shape[0] * k.shape[1] * k.shape[2]) < 2**31
    if cfg.tma == 2 and all(t.is_contiguous() for t in (q, k, v)) and tma_ok(q, k, v) and rows_fit:
        return 2
    if cfg.tma >= 1 and tma_ok(q, k, v):
        return 1
    return 0


def power_of_two_part(scale: float) -> float:
    """The power of two nearest |scale| within [1/64, 1] (1 for 0): q times it is exact in bf16, and in
    fp16 for |q| >= 2^-14 / (that power); it never overflows."""
    if scale == 0:
        return 1.0
    return 2.0 ** min(0, max(-6, round(math.log2(abs(scale)))))


def _launch_tuned(cfg: TileConfig, q, k, v, o, lse, scale, causal):
    launch_forward(forward_call(cfg, q, k, v, o, lse, scale, causal), q, k, v, o, lse)


_LAUNCH_PLANS: dict = {}   # what forward_call works out per (tile, shapes, strides, dtype, alignment, scale): host time


def forward_call(cfg: TileConfig, q, k, v, o, lse, scale, causal) -> tuple:
    """All of a forward launch but its tensors (descriptor mode, grid, the ints and floats after the tensors, meta),
    from the tile, q, k, v, o's shapes, strides, dtype, device, q, k, v's 16-byte alignment, lse, causal, scale."""
    key = (cfg, q.shape, k.shape, q.stride(), k.stride(), v.stride(), o.stride(), q.dtype, q.device,
           aligned16(q), aligned16(k), aligned16(v), lse is None, bool(causal), traced(q), scale)
    call = _LAUNCH_PLANS.get(key)
    if call is None:
        B, H, N, D = q.shape
        n_kv, BD = k.shape[2], block_d(D)
        meta = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=BD, CAUSAL=bool(causal),
                    STORE_LSE=lse is not None, TMA=_tma_mode(cfg, q, k, v),
                    DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
                    NUM_STAGES=cfg.num_stages, Q_REGS=cfg.q_regs, EVEN_D=D == BD,
                    num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        qk_scale, q_scale = scale * LOG2E, 1.0
        if cfg.q_regs:
            q_scale = power_of_two_part(qk_scale)
            qk_scale /= q_scale
        tail = (*q.stride(), *k.stride(), *v.stride(), *o.stride(), H, H // k.shape[1], N, n_kv, D, n_kv - N,
                qk_scale, q_scale)
        call = _LAUNCH_PLANS[key] = (meta["TMA"], (triton.cdiv(N, cfg.block_m) * B * H,), tail, meta)
    return call


def launch_forward(call: tuple, q, k, v, o, lse) -> None:
    """The launch of a :func:`forward_call` on these tensors (descriptors, when it has them, made here)."""
    tma, grid, tail, meta = call
    if tma == 1:    # descriptors made on the device take their scratch memory from Triton's allocator
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=env.DEVICE))
    elif tma == 2:
        D, BD = q.shape[3], meta["BLOCK_D"]
        q = TensorDescriptor.from_tensor(q.view(-1, D), [meta["BLOCK_M"], BD])
        k, v = (TensorDescriptor.from_tensor(t.view(-1, D), [meta["BLOCK_N"], BD]) for t in (k, v))
    launch(attn_fwd_tuned_kernel, "attn_fwd", grid, (q, k, v, o, lse if lse is not None else o, *tail), meta)


def choose(cands, key, launch):
    """The fastest candidate ``launch(cfg)`` for ``key`` (timed once, on a GPU only: :mod:`.choice`)."""
    return choice.fastest(cands, key, launch, _BEST)


def flash_attention(q, k, v, causal=False, sm_scale=None, return_lse=False, config: TileConfig | None = None):
    """softmax(q k^T * sm_scale [+ causal mask]) v, q (B, H, n_q, d), k/v (B, H_kv, n_kv, d) (v2, tuned).

    ``sm_scale`` defaults to 1/sqrt(d); ``return_lse=True`` also returns the float32 log-sum-exp of
    each row (B, H, n_q). ``config`` forces a tile configuration; otherwise the fastest of
    :func:`attention_configs` is kept per shape on a GPU."""
    scale, o, lse = prepare(q, k, v, causal, sm_scale, return_lse)
    if o.numel() == 0:
        return (o, lse) if return_lse else o
    if config is None:
        cands = attention_configs(hardware.device_info(), q.shape[3], q.dtype, causal)
        key = ("fwd", torch.cuda.current_device() if env.on_gpu() else -1, q.shape, k.shape, q.dtype,
               bool(causal), lse is not None, tma_ok(q, k, v, o))
        config = choose(cands, key, lambda c: _launch_tuned(c, q, k, v, o, lse, scale, causal))
    _launch_tuned(config, q, k, v, o, lse, scale, causal)
    global last_config
    last_config = config
    return (o, lse) if return_lse else o


def compile_cases(info):
    """The compile matrix's launches (course_utils/aot.py): every tile, mask, padded d, GQA, 2^31+."""
    from ..aot import dtype_name, dtypes_for, empty
    from ..kernels.attention import flash_attention_teaching as teaching

    def qkv(d, dt, heads=2, kv_heads=2, n=256):
        return empty(1, heads, n, d, dtype=dt), empty(1, kv_heads, n, d, dtype=dt), empty(1, kv_heads, n, d, dtype=dt)

    for dt in dtypes_for(info):
        n = dtype_name(dt)
        for d, cfg in [(128, c) for c in attention_configs(info, 128, dt, False)] + [
                (256, attention_configs(info, 256, dt, False)[0])]:
            yield f"flash_attention {n} d={d} {cfg}", lambda d=d, dt=dt, c=cfg: flash_attention(*qkv(d, dt), config=c)
        for d, c in ((64, False), (64, True), (128, True), (80, True), (40, False)):
            cfg = attention_configs(info, d, dt, c)[0]
            yield (f"flash_attention {n} d={d} causal={c} lse gqa {cfg}", lambda d=d, dt=dt, c=c, cfg=cfg:
                   flash_attention(*qkv(d, dt, 4, 2), c, return_lse=True, config=cfg))
            yield f"teaching {n} d={d} causal={c}", lambda d=d, dt=dt, c=c: teaching(*qkv(d, dt), c, return_lse=True)
    big = (2**17 + 64, 2**17 + 64, 64)  # 2^31 + 2^20 elements per tensor at d=256: nothing is allocated
    cfg = attention_configs(info, 256, torch.float16, True)[0]
    yield "flash_attention 2^31+", lambda: flash_attention(*qkv(256, torch.float16, *big), True, config=cfg)
    yield "teaching 2^31+", lambda: teaching(*qkv(256, torch.float16, *big), True)
