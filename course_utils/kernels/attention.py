"""FlashAttention forward: softmax(Q K^T * scale) V without ever writing the scores to memory.

Version ladder (chapter 7):
  v0 ``attention_ref``: three launches (S = Q K^T, P = softmax(S), O = P V); S and P go to HBM.
  v1 ``attn_fwd_kernel`` / ``flash_attention_teaching``: one program per (query tile, batch*head),
     online softmax over key tiles, masks on every tile; its plain loop over ``tl.dot`` is
     software-pipelined by Triton's default stages (results/ptx/pipelining_ptx.csv).
  v2 ``course_utils.tuned.attention.flash_attention``: v1 in base 2, masks only on ragged or
     diagonal tiles, stages set per tile (``tl.range(..., num_stages=...)``), tiles chosen per
     device, tensor-descriptor (TMA) loads on sm_90. The backward is in ``attention_backward``.
  ``local_attention_ref``: the sliding-window variant (exercise 7.2's reference), eager, no kernel.

Every ``tl.dot`` of float32 inputs runs in IEEE precision (``dot_precision``), not a GPU's TF32 default.

Every version takes q (batch, heads, n_q, d) and k, v (batch, kv_heads, n_kv, d): any d up to 256
(padded inside the kernel to a power of two, with masks), grouped-query attention (heads a multiple
of kv_heads: q head h reads k/v head h // (heads // kv_heads)), and causal masks aligned
bottom-right when n_q != n_kv (query i sees key j when j <= i + n_kv - n_q, as FlashAttention does;
PyTorch's SDPA aligns top-left). A query that sees no key outputs 0 (log-sum-exp -inf).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import env, hardware

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEAD_DIMS = (16, 32, 64, 128)  # the head dims the tuned tiles were measured for; any d <= 256 runs
MAX_HEAD_DIM = 256
LOG2E = 1.4426950408889634


@triton.jit
def head_offset(b, h, stride_b, stride_h):
    """Where head ``h`` of batch ``b`` starts, in int64: batch * heads * seq * d passes 2^31."""
    return b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h


@triton.jit
def tile_offsets(rows, cols, row_stride, col_stride):
    """Offsets of a (rows x cols) tile, in int64 (a strided head alone can span 2^31 elements)."""
    return rows.to(tl.int64)[:, None] * row_stride + cols.to(tl.int64)[None, :] * col_stride


@triton.jit
def attn_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,
                    stride_qb, stride_qh, stride_qn, stride_qd,
                    stride_kb, stride_kh, stride_kn, stride_kd,
                    stride_vb, stride_vh, stride_vn, stride_vd,
                    stride_ob, stride_oh, stride_on, stride_od,
                    n_heads, group, n_q, n_kv, head_dim, causal_offset, sm_scale,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    CAUSAL: tl.constexpr, STORE_LSE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # torch.compile passes floats as fp64: keep the math in float32 (tl.cast: the interpreter passes a Python float)
    sm_scale = tl.cast(sm_scale, tl.float32)
    # Which query tile and which (batch, head) this program owns: a 1-D grid, query tiles fastest.
    pid = tl.program_id(0)
    n_m_tiles = tl.cdiv(n_q, BLOCK_M)
    pid_m = pid % n_m_tiles
    pid_bh = pid // n_m_tiles
    b = pid_bh // n_heads
    h = pid_bh % n_heads
    h_kv = h // group                                  # grouped-query: heads share a k/v head
    q_ptr += head_offset(b, h, stride_qb, stride_qh)
    k_ptr += head_offset(b, h_kv, stride_kb, stride_kh)
    v_ptr += head_offset(b, h_kv, stride_vb, stride_vh)
    o_ptr += head_offset(b, h, stride_ob, stride_oh)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)   # query rows of this tile
    offs_n = tl.arange(0, BLOCK_N)                     # key columns of one key/value tile
    offs_d = tl.arange(0, BLOCK_D)                     # head dim, padded to a power of two
    mask_m = offs_m < n_q
    mask_d = offs_d < head_dim                         # padded columns load 0: they add 0 to Q K^T

    # The query tile stays in SRAM (registers) for the whole loop.
    q = tl.load(q_ptr + tile_offsets(offs_m, offs_d, stride_qn, stride_qd),
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)

    # Running state of the online softmax, one value per query row.
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max of the scores
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)                # running sum of exp(score - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)       # running sum of exp(score - m_i) * v

    # Causal: query i sees key j when j <= i + causal_offset; later keys are never loaded.
    hi = n_kv
    if CAUSAL:
        hi = tl.minimum(n_kv, (pid_m + 1) * BLOCK_M + causal_offset)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        mask_n = cols < n_kv
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_ptr + tile_offsets(cols, offs_d, stride_kn, stride_kd), mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + tile_offsets(cols, offs_d, stride_vn, stride_vd), mask=kv_mask, other=0.0)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale  # scores, BLOCK_M x BLOCK_N, fp32
        keep = mask_n[None, :]                                 # padding keys past the end count for nothing
        if CAUSAL:
            keep = keep & (cols[None, :] <= offs_m[:, None] + causal_offset)
        s = tl.where(keep, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))             # new running max
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)   # a row with no key yet: exp(-inf) = 0, not NaN
        alpha = tl.exp(m_i - m_use)                            # rescales what was summed so far
        p = tl.exp(s - m_use[:, None])                         # <= 1: no overflow, however large s is
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]        # a row that saw no key: 0
    tl.store(o_ptr + tile_offsets(offs_m, offs_d, stride_on, stride_od),
             out.to(o_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])
    if STORE_LSE:
        tl.store(lse_ptr + pid_bh.to(tl.int64) * n_q + offs_m, m_i + tl.log(l_i), mask=mask_m)


_attn_fwd_teaching = attn_fwd_kernel  # old name (notebook 07 prints it); see RENAMES


def validate(q, k, v, causal=False):
    """Raise a clear error unless q (B, H, N, d) and k, v (B, H_kv, N_kv, d) can be computed."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, heads, seq, head_dim), got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in DTYPES:
        raise TypeError(f"dtype must be float16, bfloat16 or float32, got {q.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.device.type != env.DEVICE.type:
        raise ValueError(f"tensors must be on the {env.DEVICE.type} device in {env.MODE} mode, got {q.device}")
    if q.dtype == torch.bfloat16:
        if not env.on_gpu():
            raise TypeError("bfloat16 arithmetic is wrong under Triton's interpreter: "
                            "use float16 or float32 on CPU")
        if not hardware.device_info().has_bf16:
            raise TypeError("this GPU has no bfloat16 (it needs sm_80 or newer): use float16")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    B, H, N, D = q.shape
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k/v shape {tuple(k.shape)} does not match q {tuple(q.shape)} in batch or head_dim")
    if k.shape[1] == 0 or H % k.shape[1]:
        raise ValueError(f"q heads ({H}) must be a multiple of k/v heads ({k.shape[1]}): grouped-query "
                         "attention gives each k/v head the same number of q heads")
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be between 1 and {MAX_HEAD_DIM}, got {D}")
    if N > 0 and k.shape[2] == 0 and B * H > 0:
        raise ValueError("no keys: softmax over an empty row is undefined")


def prepare(q, k, v, causal, sm_scale, return_lse):
    """Validate, pick the scale (1/sqrt(d) by default), allocate the output (and log-sum-exp)."""
    validate(q, k, v, causal)
    B, H, N, D = q.shape
    scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    if not math.isfinite(scale):
        raise ValueError(f"sm_scale must be finite, got {sm_scale}")
    o = torch.empty((B, H, N, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, N), dtype=torch.float32, device=q.device) if return_lse else None
    return scale, o, lse


def dot_precision(dtype: torch.dtype) -> str | None:
    """``tl.dot``'s ``input_precision`` for ``dtype``: "ieee" for float32, whose default on a GPU is TF32
    (each input rounded to a 10-bit mantissa); None (Triton's default) for 16-bit inputs."""
    return "ieee" if dtype == torch.float32 else None


def block_d(head_dim: int) -> int:
    """The head dim a kernel works with: the next power of two, at least 16 (``tl.dot``'s minimum)."""
    return max(16, triton.next_power_of_2(head_dim))


def flash_attention_teaching(q, k, v, causal=False, sm_scale=None, return_lse=False,
                             block_m: int = 32, block_n: int = 16):
    """The readable kernel (v1), launched as ``kernel[grid](...)``. Same contract as ``flash_attention``."""
    scale, o, lse = prepare(q, k, v, causal, sm_scale, return_lse)
    if o.numel() == 0:
        return (o, lse) if return_lse else o
    B, H, N, D = q.shape
    n_kv = k.shape[2]
    grid = (triton.cdiv(N, block_m) * B * H,)
    attn_fwd_kernel[grid](q, k, v, o, lse if return_lse else o,
                          *q.stride(), *k.stride(), *v.stride(), *o.stride(),
                          H, H // k.shape[1], N, n_kv, D, n_kv - N, scale,
                          BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d(D), CAUSAL=bool(causal),
                          STORE_LSE=bool(return_lse), DOT_PRECISION=dot_precision(q.dtype))
    return (o, lse) if return_lse else o


def attention_ref(q, k, v, causal=False, sm_scale=None, return_lse=False):
    """Standard attention, eager: S = Q K^T * scale, P = softmax(S), O = P V, with S and P in memory.

    Launches, as ``course_utils.profile.count_launches`` counts them: three (baddbmm, softmax, bmm).
    Causal adds three: the (n_q x n_kv) mask built once (ones, triu) and one in-place masked_fill over S;
    a query that sees no key (n_q > n_kv, causal) one more (nan_to_num). Grouped-query heads read
    their shared k/v head by a view (no copy); a non-contiguous input is copied first (one more).
    In 16-bit, S and P are 16-bit (softmax accumulates in fp32 inside its one kernel).
    """
    B, H, N, D = q.shape
    H_kv, n_kv = k.shape[1], k.shape[2]
    group = H // H_kv
    scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    # The `group` q heads of one k/v head stacked along the rows: (B * H_kv, group * N, D).
    q3 = q.reshape(B * H_kv, group * N, D)
    k3 = k.reshape(B * H_kv, n_kv, D)
    v3 = v.reshape(B * H_kv, n_kv, D)
    s = torch.baddbmm(q3.new_empty(1, 1, 1), q3, k3.transpose(1, 2), beta=0, alpha=scale)  # beta=0: ignored
    if causal:
        drop = torch.ones(N, n_kv, dtype=torch.bool, device=q.device).triu(n_kv - N + 1)
        s.masked_fill_(drop.repeat(group, 1) if group > 1 else drop, float("-inf"))
    p = torch.softmax(s, dim=-1)
    if causal and N > n_kv:
        p = p.nan_to_num(0.0)  # softmax of a row of -inf is NaN; FlashAttention's answer is 0
    o = torch.bmm(p, v3).view(B, H, N, D)
    if return_lse:
        s32 = s if s.dtype == torch.float64 else s.float()
        return o, torch.logsumexp(s32, dim=-1).view(B, H, N)
    return o



def local_attention_ref(q, k, v, window: int, sm_scale=None):
    """Sliding-window (local) causal attention, eager: query i sees the ``window`` keys j with
    i + off - window < j <= i + off, off = n_kv - n_q (the causal mask's bottom-right alignment; 0 when
    n_q == n_kv). Every score outside the band is -inf before the softmax; a query that sees no key
    outputs 0. Computes in the inputs' dtype (float64 inputs: the checkers' reference)."""
    if int(window) < 1:
        raise ValueError(f"window must be at least 1 (a query sees itself), got {window}")
    N, n_kv, D = q.shape[2], k.shape[2], q.shape[3]
    group = q.shape[1] // k.shape[1]
    scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    kk = k.repeat_interleave(group, dim=1) if group > 1 else k
    vv = v.repeat_interleave(group, dim=1) if group > 1 else v
    s = (q @ kk.transpose(-1, -2)) * scale
    i = torch.arange(N, device=q.device)[:, None] + (n_kv - N)
    j = torch.arange(n_kv, device=q.device)[None, :]
    seen = (j <= i) & (j > i - int(window))
    p = torch.softmax(s.masked_fill(~seen, float("-inf")), dim=-1).nan_to_num(0.0)
    return p @ vv


# --------------------------------------------------------------------------------------------------


# Measuring memory (chapter 7's memory cell). Moving to course_utils.profile (shelves-elementwise).
def peak_bytes(fn, *args, **kwargs) -> int:
    """Peak bytes of tensors that ``fn(*args, **kwargs)`` allocates, above what was allocated before.

    On a GPU: the CUDA caching allocator's peak (``torch.cuda.max_memory_allocated``). On the CPU:
    every tensor an operator creates is tracked until it is freed (inputs and views not counted),
    so the number is the same bookkeeping, done by the course instead of the allocator. Copies the
    Triton interpreter makes of a kernel's arguments are not counted: on a GPU they do not exist.
    """
    if env.on_gpu():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn(*args, **kwargs)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    import sys
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode

    def _inside_interpreter() -> bool:
        f = sys._getframe(2)
        while f is not None:
            if "triton" in f.f_code.co_filename and "interpreter" in f.f_code.co_filename:
                return True
            f = f.f_back
        return False

    live: dict[int, int] = {}
    state = {"now": 0, "peak": 0}

    def _free(ptr):
        state["now"] -= live.pop(ptr, 0)

    class _Track(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if _inside_interpreter():
                return out
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                    ptr = t.untyped_storage().data_ptr()
                    if ptr and ptr not in live:
                        live[ptr] = t.untyped_storage().nbytes()
                        state["now"] += live[ptr]
                        state["peak"] = max(state["peak"], state["now"])
                        weakref.finalize(t, _free, ptr)
            return out

    with _Track():
        result = fn(*args, **kwargs)
    del result
    return state["peak"]
