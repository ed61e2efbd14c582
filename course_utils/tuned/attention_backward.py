"""FlashAttention backward, the tuned shelf (v2 of ``kernels.attention_backward``), and the autograd
Function pairing it with the tuned forward. (The two kernels and their tile loops are in
:mod:`.attention_backward_kernels`, re-exported here.)

v1's kernels in base 2, the causal mask only on diagonal tiles (ragged edges: zero-filled loads),
the dK/dV products computed transposed (K Q^T, V dO^T), software pipelining, tiles per device,
IEEE dots for float32. dQ has its own pass; ``BwdConfig.atomic_dq`` adds dS K from the dK/dV
programs into a float32 buffer with atomics instead. On an H100 (results/h100-80gb-hbm3/
attention_bwd_tiles.csv, 64 x 128 tiles both ways, forward + backward times) atomics lost 6 of 8
cases (up to 9.5%), tied one and won one by 3%; with 32-row query tiles they were up to 1.6x slower.
The own pass redoes Q K^T and dO V^T per tile but writes dQ once: no float32 scratch, and run-to-run
identical gradients for a fixed tile configuration without atomics (``config=``; unpinned, the fastest
is chosen by timing, per process, and on sm_90 at d=128 an atomic candidate is among those timed).
``BwdConfig.tma`` loads the streamed tiles (q and dO in the dK/dV pass, k and v in the dQ pass) through
tensor descriptors made on the host, where the inputs allow it (contiguous, whole tiles, d a power of two).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import env, hardware
from ..kernels.attention import LOG2E, block_d
from ..kernels.attention_backward import (
    attn_bwd_preprocess_kernel,
    check_backward_inputs,
    dot_precision,
    row_delta,  # noqa: F401  (importable from here, as before)
)
from .attention import choose, flash_attention, tma_ok
from .attention_backward_kernels import (  # noqa: F401  (re-exported: the kernels by the names callers use)
    attn_bwd_dkdv_tiles,
    attn_bwd_dkdv_tuned_kernel,
    attn_bwd_dq_tiles,
    attn_bwd_dq_tuned_kernel,
)
from .launch import aligned16, launch, traced


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
# float32: every product in IEEE float32 on the FMA units, no tensor cores, and no speed target. Its compile
# time grows with the tile: the first of the three tiles above took 55 s for one d=96 launch on an idle H200,
# and a first float32 call timing all three took 329 s among make test-gpu's workers (results/h200/
# test_gpu_s17.log). One small tile, no timed choice: the first call is what a float32 user waits for.
_FP32_BWD = [BwdConfig(16, 32, 32, 16, 4, 1)]
INTERPRETER_BWD = BwdConfig(16, 32, 32, 16, 4, 1)
SMALLEST_BWD = _SMALL_BWD[256][0]  # when nothing fits by the estimate (fp32, d=256 on 64 KiB)


def backward_configs(info: hardware.DeviceInfo, head_dim: int, dtype: torch.dtype) -> list[BwdConfig]:
    """The backward tile configurations tried on ``info`` (those that fit its shared memory)."""
    if info == hardware.INTERPRETER_DEVICE:
        return [INTERPRETER_BWD]
    itemsize = torch.empty((), dtype=dtype).element_size()
    bd = block_d(head_dim)
    if itemsize == 4:
        cands = _FP32_BWD
    elif info.arch >= 90:
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
    launch_backward(backward_call(cfg, q, k, v, do, dq, dk, dv, scale, causal), q, k, v, do, lse, delta, dq, dk, dv)


def backward_call(cfg: BwdConfig, q, k, v, do, dq, dk, dv, scale, causal) -> tuple:
    """All of the dK/dV and dQ launches but their tensors: (descriptors or not, atomic dQ or not, then grid, the ints
    and floats after the tensors, and meta of each launch). The ops keep it per exact call (host time)."""
    B, H, N, D = q.shape
    H_kv, n_kv = k.shape[1], k.shape[2]
    tma, grid_kv, meta_kv, grid_q, meta_q = _launch_plan(cfg, q, k, v, do, causal)
    common = (*q.stride(), *k.stride(), *v.stride(), *do.stride(), H, H // H_kv, N, n_kv, D, n_kv - N,
              scale * LOG2E, scale)
    return (tma, cfg.atomic_dq, grid_kv, (*common, *dk.stride()[:3], *dv.stride()[:3]), meta_kv,
            grid_q, (*common, *dq.stride()[:3]), meta_q)


def launch_backward(call: tuple, q, k, v, do, lse, delta, dq, dk, dv) -> None:
    """The launches of a :func:`backward_call` on these tensors (descriptors, when it has them, made here)."""
    tma, atomic_dq, grid_kv, tail_kv, meta_kv, grid_q, tail_q, meta_q = call
    q_in, do_in, k_in, v_in = q, do, k, v
    if tma:
        D, BD = q.shape[3], meta_kv["BLOCK_D"]
        q_in, do_in = (TensorDescriptor.from_tensor(t.view(-1, D), [meta_kv["BLOCK_M"], BD]) for t in (q, do))
        k_in, v_in = (TensorDescriptor.from_tensor(t.view(-1, D), [meta_q["BLOCK_N"], BD]) for t in (k, v))
    dq_buf = dq
    if atomic_dq:   # a contiguous float32 scratch for the atomics, copied into dq (of any strides) after
        dq_buf = torch.zeros(dq.shape, dtype=torch.float32, device=dq.device)
    launch(attn_bwd_dkdv_tuned_kernel, "attn_bwd_dkdv", grid_kv, (q_in, k, v, do_in, lse, delta, dk, dv, dq_buf,
                                                                  *tail_kv), meta_kv)
    if atomic_dq:
        dq.copy_(dq_buf)
    else:
        launch(attn_bwd_dq_tuned_kernel, "attn_bwd_dq", grid_q, (q, k_in, v_in, do, lse, delta, dq, *tail_q), meta_q)


_LAUNCH_PLANS: dict = {}   # what _launch_plan works out per (tiles, shapes, strides, dtype, alignment): host time


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
    B, H, N, _ = o.shape
    delta = torch.empty((B, H, N), dtype=torch.float32, device=o.device)
    launch_delta(delta_call(o, do, block_m), o, do, delta)
    return delta


def delta_call(o: torch.Tensor, do: torch.Tensor, block_m: int = 64) -> tuple:
    """(grid, the ints after the tensors, meta) of :func:`delta_rows`' launch (the ops keep it per exact call)."""
    B, H, N, D = o.shape
    return (-(-N // block_m) * B * H,), (*o.stride(), *do.stride(), H, N, D), dict(BLOCK_M=block_m, BLOCK_D=_block_d(D))


def launch_delta(call: tuple, o, do, delta) -> None:
    grid, tail, meta = call
    launch(attn_bwd_preprocess_kernel, "attn_bwd_delta", grid, (o, do, delta, *tail), meta)


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
