"""The tuned GEMM with its epilogue (chapter 9, v3): what ``linear_gelu`` and ``matmul`` run.

- sm_90 with 16-bit inputs whose rows are 16-byte aligned: ``_gemm_tma_persistent``, tensor
  descriptors made on the device (``tl.make_tensor_descriptor``: the TMA copy engine loads whole
  tiles, zero-fills past the edges and clips the store), one program per SM walking the output tiles
  in grouped order (a persistent loop, flattened into one software pipeline: the next tile's first
  loads can be issued before this tile's epilogue, but the epilogue's arithmetic and store still run
  after the K loop, on the same warps: on an H100 (2026-11-27) it cost 6-16% over the matmul alone at the
  two smaller MLP shapes, chapter 9's section 5).
- everything else (sm_80, sm_75, float32, odd strides): the teaching kernel with tiles per device.
- ``TileConfig(split_k=S)``, a plan chosen only when asked for (no default proposes it): split-K in two
  deterministic launches, ``_splitk_partial_kernel`` (program (tile, s) sums K slice s into a float32
  workspace) then ``_splitk_epilogue_kernel`` (adds the S partial tiles, applies the epilogue, stores).
  For decode shapes, where a few hundred tiles are too few programs to keep every SM's loads in flight;
  the extra bytes are S x M x N x 4, written once and read once.

Tiles are a pure function of a :class:`~course_utils.hardware.DeviceInfo` and the shape
(:func:`gemm_configs`); where several remain, the fastest is timed once per shape on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .. import env, hardware
from ..kernels.gemm import (
    check_operands,
    dot_precision,
    epilogue,
    grouped_tile,
    linear_gelu_ref,
    matmul_kernel,
    tile_matmul,
)
from . import choice
from .launch import aligned16


@triton.jit
def _splitk_partial_kernel(x_ptr, w_ptr, ws_ptr, M, N, K, stride_xm, stride_xk, stride_wk, stride_wn, K_PER_SPLIT,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Split-K, stage 1: program (tile, s) sums its tile over K slice s (K_PER_SPLIT long, a multiple of
    BLOCK_K) and stores the float32 partial tile in ws[s] (contiguous M x N)."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    split = tl.program_id(1).to(tl.int64)
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = split * K_PER_SPLIT
    k_len = tl.minimum(K - k_start, K_PER_SPLIT)     # the last slice may be shorter: tile_matmul masks it
    acc = tile_matmul(x_ptr + k_start * stride_xk, w_ptr + k_start * stride_wk, offs_m, offs_n, M, N, k_len,
                      stride_xm, stride_xk, stride_wk, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)
    tl.store(ws_ptr + split * M * N + offs_m[:, None] * N + offs_n[None, :], acc,
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit(do_not_specialize=["seed"])
def _splitk_epilogue_kernel(ws_ptr, c_ptr, bias_ptr, M, N, p, keep_scale, seed, SPLITS: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
                            GELU: tl.constexpr, DROPOUT: tl.constexpr):
    """Split-K, stage 2: the SPLITS partial tiles added in a fixed order (deterministic), then the epilogue."""
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    idx = offs_m[:, None] * N + offs_n[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(ws_ptr + s * M * N + idx, mask=mask, other=0.0)
    acc = epilogue(acc, offs_m, offs_n, M, N, bias_ptr, p, keep_scale, seed, HAS_BIAS, GELU, DROPOUT)
    tl.store(c_ptr + idx, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["seed"])
def _gemm_tma_persistent(x_ptr, w_ptr, c_ptr, bias_ptr, M, N, K, stride_x, stride_w,
                         p, keep_scale, seed,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, X_T: tl.constexpr, W_T: tl.constexpr,
                         HAS_BIAS: tl.constexpr, GELU: tl.constexpr, DROPOUT: tl.constexpr,
                         FLATTEN: tl.constexpr, WS: tl.constexpr, SUBTILE: tl.constexpr):
    """X_T / W_T: the operand is stored transposed (its first dimension has stride 1). SUBTILE: the
    epilogue and the store work on two BLOCK_N / 2 halves (half the shared memory for the store,
    which buys a pipeline stage)."""
    if X_T:   # x is the transpose of a (K, M) row-major matrix
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[K, M], strides=[stride_x, 1], block_shape=[BLOCK_K, BLOCK_M])
    else:
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_x, 1], block_shape=[BLOCK_M, BLOCK_K])
    if W_T:   # w is the transpose of an (N, K) row-major matrix (an nn.Linear weight)
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[stride_w, 1], block_shape=[BLOCK_N, BLOCK_K])
    else:
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[K, N], strides=[stride_w, 1], block_shape=[BLOCK_K, BLOCK_N])
    HALF_N: tl.constexpr = BLOCK_N // (2 if SUBTILE else 1)
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, HALF_N])

    start_pid = tl.program_id(axis=0)
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile_id in tl.range(start_pid, num_tiles, NUM_SMS, flatten=FLATTEN, warp_specialize=WS):
        pid_m, pid_n = grouped_tile(tile_id, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            off_k = ki * BLOCK_K
            if X_T:
                a = x_desc.load([off_k, off_m]).T
            else:
                a = x_desc.load([off_m, off_k])
            if W_T:
                b = w_desc.load([off_n, off_k]).T
            else:
                b = w_desc.load([off_k, off_n])
            acc = tl.dot(a, b, acc)
        offs_m = off_m + tl.arange(0, BLOCK_M)
        if SUBTILE:
            acc0, acc1 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, HALF_N)), (0, 2, 1)))
            offs_n = off_n + tl.arange(0, HALF_N)
            acc0 = epilogue(acc0, offs_m, offs_n, M, N, bias_ptr, p, keep_scale, seed, HAS_BIAS, GELU, DROPOUT)
            c_desc.store([off_m, off_n], acc0.to(c_ptr.dtype.element_ty))
            acc1 = epilogue(acc1, offs_m, offs_n + HALF_N, M, N, bias_ptr, p, keep_scale, seed,
                            HAS_BIAS, GELU, DROPOUT)
            c_desc.store([off_m, off_n + HALF_N], acc1.to(c_ptr.dtype.element_ty))
        else:
            offs_n = off_n + tl.arange(0, BLOCK_N)
            acc = epilogue(acc, offs_m, offs_n, M, N, bias_ptr, p, keep_scale, seed, HAS_BIAS, GELU, DROPOUT)
            c_desc.store([off_m, off_n], acc.to(c_ptr.dtype.element_ty))


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    tma: bool = False       # the persistent tensor-descriptor kernel (sm_90, 16-bit inputs)
    flatten: bool = True    # flatten the tile and K loops into one software pipeline
    ws: bool = False        # warp specialization (producer/consumer warps)
    subtile: bool = False   # epilogue and store in two halves of the tile (tma only)
    per_sm: int = 1         # persistent programs per SM (tma only)
    split_k: int = 1        # > 1: split-K in two launches (pointer loads; tma, ws, subtile, per_sm unused)

    def smem_bytes(self, itemsize: int) -> int:
        stage = (self.block_m + self.block_n) * self.block_k * itemsize
        store = self.block_m * self.block_n * itemsize // (2 if self.subtile else 1) if self.tma else 0
        return self.num_stages * stage + store


# Hopper candidates, from the tile sweep on an H100 (results/h100-80gb-hbm3/gemm_tiles_explore.csv, bf16,
# against torch.mm): 128 x 256 x 64 tiles, 8 warps (two consumer warpgroups), 3 stages and a flattened
# persistent loop reached 0.86-0.96 of cuBLAS; 128 x 128 tiles 0.76-0.87, pointers instead of descriptors
# 0.73-0.85, warp specialization gained nothing (0-1% slower at 128 x 256, up to 2.4% at 128 x 128). A shorter
# group is the neighbour the launcher times beside it. The subtiled store with a 4th stage needs 4 x 48 KiB +
# 32 KiB = 224 KiB of shared memory, above gemm_configs' budget (95% of the H100's 227 KiB per block): it is
# never tried on an H100 and stays listed for a device with more; with 3 stages it fits (176 KiB by
# smem_bytes, 180248 bytes in the sm_90 compile matrix), and benchmarks/gemm.py times it as fused_subtile
# beside the default (the first half's TMA store in flight while the second half's GELU runs). In the
# make-bench run of 2026-11-24 (results/h100-80gb-hbm3/gemm.csv at commit 731c4f6, replaced since by the runs
# of 2026-11-25 and 2026-11-27, which chapter 9 reads) the launcher kept 128 x 256 x 64, 3 stages at every MLP
# shape, where the matmul alone reached 0.95-1.01 of torch.mm and the epilogue (fused / matmul - 1) cost
# another 6.4-14.2%, against -0.9 to +4.8% for cuBLASLt's (addmm_act / mm - 1). Decode (M <= 64) is
# memory-bound: pointer tiles of 16 or 64 rows streamed W at 0.94-0.97 of torch.mm there. The decode sweep on
# an H200 (results/h200/gemm_decode_tiles.csv: 19 tiles at M <= 16, 14 at M = 64, CUDA graphs) put pointer
# tiles 128 columns wide, 128 deep, 4 stages first at every M and dtype: 1.03-1.05x addmm + GELU, where the
# descriptor tile of 64 rows the launcher had kept at M = 64 ran 0.975x.
_HOPPER_LARGE = [TileConfig(128, 256, 64, 8, 3, tma=True), TileConfig(128, 256, 64, 8, 4, tma=True, subtile=True),
                 TileConfig(128, 256, 64, 8, 3, group_m=4, tma=True)]
_HOPPER_DECODE_16 = [TileConfig(16, 128, 128, 4, 4), TileConfig(16, 64, 128, 4, 6), TileConfig(16, 64, 256, 4, 3),
                     TileConfig(16, 64, 128, 4, 4, tma=True, per_sm=2)]
_HOPPER_DECODE_64 = [TileConfig(64, 128, 128, 4, 4), TileConfig(64, 128, 64, 4, 8),
                     TileConfig(64, 128, 128, 4, 4, tma=True), TileConfig(64, 64, 128, 4, 3, tma=True, per_sm=2)]
_AMPERE = [TileConfig(128, 128, 32, 4, 4), TileConfig(128, 64, 32, 4, 4)]
_SMALL = [TileConfig(64, 64, 32, 4, 2)]             # T4 / consumer: 64 KiB shared memory per block
_FP32 = [TileConfig(64, 64, 32, 4, 2)]              # float32 multiplies in full precision: no tensor cores
INTERPRETER_TILES = TileConfig(16, 16, 16, 1, 1, group_m=2)  # tiny tiles: small tests still cross many


def gemm_configs(info: hardware.DeviceInfo, M: int, N: int, K: int, dtype: torch.dtype,
                 tma_ok: bool = True) -> list[TileConfig]:
    """The tile configurations :func:`linear_gelu` tries for an (M, K) x (K, N) product on ``info``."""
    if info == hardware.INTERPRETER_DEVICE:
        return [INTERPRETER_TILES]
    itemsize = torch.empty((), dtype=dtype).element_size()
    if itemsize == 4:
        cands = _FP32
    elif info.arch >= 90:
        cands = _HOPPER_DECODE_16 if M <= 16 else _HOPPER_DECODE_64 if M <= 64 else _HOPPER_LARGE
        if not tma_ok:
            cands = [replace(c, tma=False, ws=False, subtile=False, per_sm=1) for c in cands]
    elif info.arch >= 80 and info.smem_per_block_bytes >= 160 * 1024:
        cands = _AMPERE
    else:
        cands = _SMALL
    budget = int(info.smem_per_block_bytes * 0.95)
    fits = list(dict.fromkeys(c for c in cands if c.smem_bytes(itemsize) <= budget))
    return fits or [TileConfig(32, 32, 32, 4, 1)]


def _tma_layout(t: torch.Tensor):
    """(transposed, leading stride) when ``t`` can be a tensor descriptor's source, else None."""
    if not aligned16(t):
        return None
    for transposed, (inner, outer) in ((False, t.stride()[::-1]), (True, t.stride())):
        if inner == 1 and (outer * t.element_size()) % 16 == 0 and outer >= 1:
            return transposed, outer
    return None


def _alloc(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device=env.DEVICE)


def _launch_split_k(cfg: TileConfig, x, w, c, bias, M, N, K, scalars, flags):
    k_per_split = triton.cdiv(triton.cdiv(K, cfg.split_k), cfg.block_k) * cfg.block_k
    splits = triton.cdiv(K, k_per_split)   # at most split_k: no slice is empty
    ws = torch.empty((splits, M, N), dtype=torch.float32, device=c.device)
    tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    _splitk_partial_kernel[(tiles, splits)](
        x, w, ws, M, N, K, x.stride(0), x.stride(1), w.stride(0), w.stride(1), k_per_split,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        DOT_PRECISION=dot_precision(x.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    grid = (triton.cdiv(M, cfg.block_m), triton.cdiv(N, cfg.block_n))
    _splitk_epilogue_kernel[grid](ws, c, bias, M, N, *scalars, SPLITS=splits, BLOCK_M=cfg.block_m,
                                  BLOCK_N=cfg.block_n, **flags, num_warps=4)


def _launch(cfg: TileConfig, x, w, c, bias, M, N, K, p, seed, gelu):
    scalars = (float(p), 1.0 / (1.0 - float(p)), seed)
    flags = dict(HAS_BIAS=bias is not None, GELU=bool(gelu), DROPOUT=float(p) > 0.0)
    bias = bias if bias is not None else c
    if cfg.split_k > 1:
        _launch_split_k(cfg, x, w, c, bias, M, N, K, scalars, flags)
        return
    lx, lw = _tma_layout(x), _tma_layout(w)
    if cfg.tma and lx is not None and lw is not None and (N * c.element_size()) % 16 == 0:
        triton.set_allocator(_alloc)   # scratch for the descriptors the kernel builds on the device
        sms = hardware.device_info().sms
        tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
        _gemm_tma_persistent[(min(sms * cfg.per_sm, tiles),)](
            x, w, c, bias, M, N, K, lx[1], lw[1], *scalars,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            NUM_SMS=sms * cfg.per_sm,
            X_T=lx[0], W_T=lw[0], FLATTEN=cfg.flatten, WS=cfg.ws, SUBTILE=cfg.subtile, **flags,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        return
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n),)
    matmul_kernel[grid](x, w, c, bias, M, N, K, x.stride(0), x.stride(1), w.stride(0), w.stride(1),
                        c.stride(0), c.stride(1), *scalars,
                        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                        DOT_PRECISION=dot_precision(x.dtype), **flags,
                        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


last_config: TileConfig | None = None   # what the last call ran (benchmarks record it)
_BEST: dict = {}


def _choose(cands, x, w, c, bias, M, N, K, p, seed, gelu) -> TileConfig:
    """The fastest candidate, timed once per (device, shape, dtype, layout) in interleaved rounds."""
    if len(cands) == 1 or not env.on_gpu():
        return cands[0]
    key = (torch.cuda.current_device(), M, N, K, x.dtype, x.stride(), w.stride(), bias is not None,
           bool(gelu), p > 0)
    # a decode-sized product takes tens of microseconds: time CUDA graphs, not the host's launches
    timer = _graph_median if M <= 64 else (lambda f: choice.do_bench_median(f, warmup=3, rep=15))
    return choice.fastest(cands, key, lambda cfg: _launch(cfg, x, w, c, bias, M, N, K, p, seed, gelu), _BEST,
                          timer=timer)


def _graph_median(fn) -> float:
    from triton.testing import do_bench_cudagraph
    return do_bench_cudagraph(fn, rep=10, return_mode="median")


def linear_gelu(x, w, b=None, *, gelu: bool = True, p: float = 0.0, seed: int = 0, config: TileConfig | None = None):
    """``dropout(gelu(x @ w + b), p)`` in one kernel: x is M x K, w is K x N (any strides), b has N entries.

    GELU is the tanh form; dropout keeps element (m, n) when Philox(seed, m * N + n) >= p (chapter 4's
    mask). ``config`` forces a tile configuration (tests use it). Empty inputs give an empty result.
    """
    M, N, K = check_operands(x, w, b, p, seed)
    c = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return c
    if K == 0:
        return linear_gelu_ref(None, None, b, gelu=gelu, p=p, seed=seed, _acc=torch.zeros_like(c), out=c)
    if config is None:
        tma_ok = _tma_layout(x) is not None and _tma_layout(w) is not None
        cands = gemm_configs(hardware.device_info(), M, N, K, x.dtype, tma_ok)
        config = _choose(cands, x, w, c, b, M, N, K, p, seed, gelu)
    _launch(config, x, w, c, b, M, N, K, p, seed, gelu)
    global last_config
    last_config = config
    return c


def matmul(a, b, *, config: TileConfig | None = None):
    """``a @ b`` by the tuned kernel (no epilogue)."""
    return linear_gelu(a, b, None, gelu=False, config=config)


def compile_cases(info):
    """The launches ``python -m course_utils.aot`` compiles for ``info``: every candidate tile of the MLP
    and decode shapes (16-bit), the first one of odd shapes, transposed weights with dropout, no
    epilogue, float32, and more than 2^31 elements of x."""
    from ..aot import dtype_name, dtypes_for, empty

    def case(m, k, n, dt, cfg, w_t=False, **kw):
        w = empty(n, k, dtype=dt).T if w_t else empty(k, n, dtype=dt)
        return lambda: linear_gelu(empty(m, k, dtype=dt), w, empty(n, dtype=dt), config=cfg, **kw)

    for dt in dtypes_for(info):
        name = dtype_name(dt)
        shapes = [(333, 1000, 520)] if dt == torch.float32 else [(4096, 4096, 16384), (1, 4096, 16384),
                                                                  (64, 4096, 16384)]
        for m, k, n in shapes:
            for cfg in gemm_configs(info, m, n, k, dt):
                yield f"linear_gelu {name} {m}x{k}x{n} {cfg}", case(m, k, n, dt, cfg)
        cfg = gemm_configs(info, 256, 512, 512, dt)[0]
        yield f"linear_gelu {name} w transposed, dropout {cfg}", case(256, 512, 512, dt, cfg, True, p=0.1, seed=1)
        yield f"linear_gelu {name} odd 37x53x45 {cfg}", case(37, 53, 45, dt, cfg)
        yield (f"matmul {name} {cfg}",
               lambda dt=dt, cfg=cfg: matmul(empty(256, 512, dtype=dt), empty(512, 512, dtype=dt), config=cfg))
    cfg = gemm_configs(info, 2**20, 2048, 2048, torch.float16)[0]
    yield "linear_gelu 2^31+", case(2**20 + 1, 2048, 64, torch.float16, cfg)
    if info.arch >= 90:   # the subtiled epilogue the benchmark times at the MLP shapes (3 stages: it fits)
        cfg = replace(gemm_configs(info, 4096, 16384, 4096, torch.float16)[0], subtile=True)
        yield f"linear_gelu float16 subtiled epilogue {cfg}", case(4096, 4096, 16384, torch.float16, cfg)
    for m, split in ((16, 4), (64, 2)):   # the split-K plan the benchmark times at decode shapes
        cfg = replace(gemm_configs(info, m, 16384, 4096, torch.float16)[0], tma=False, ws=False, subtile=False,
                      per_sm=1, split_k=split)
        yield f"linear_gelu float16 split-K {m}x4096x16384 {cfg}", case(m, 4096, 16384, torch.float16, cfg)
    if info.arch < 90:   # the descriptor kernel, forced: the launcher picks it on sm_90 only, but it compiles
        cfg = TileConfig(64, 64, 32, 4, 2, tma=True)   # here too (Triton lowers descriptors to plain loads)
        yield f"linear_gelu float16 descriptor kernel (forced) {cfg}", case(256, 512, 512, torch.float16, cfg)
