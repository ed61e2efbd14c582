"""A matmul whose epilogue applies bias, GELU and dropout (chapter 9): ``dropout(gelu(x @ w + b))``.

Version ladder:
  v0 ``linear_gelu_ref``: cuBLAS's matmul, then bias, GELU (and dropout) as trailing kernels:
     the (M, N) product goes to HBM and comes back once per trailing kernel.
  v1 ``matmul_kernel`` / ``matmul_teaching``: a program per BLOCK_M x BLOCK_N output tile, the K loop
     with ``tl.dot`` into a float32 accumulator, masks for ragged M/N/K, any strides (transposed
     operands), and the grouped launch order that keeps operand tiles in L2 (GROUP_M).
  v2 the same kernel with its epilogue on (``linear_gelu_teaching``): bias per column, tanh GELU and
     the in-kernel Philox dropout mask of chapter 4, applied to the accumulator before the single store.
  v3 ``course_utils.tuned.gemm`` (what ``linear_gelu`` and ``matmul`` run): on sm_90 tensor
     descriptors (the TMA copy engine), a persistent tile loop and tiles chosen per device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .. import env, hardware
from .elementwise import dropout_keep_mask_teaching, gelu_math

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program id -> (pid_m, pid_n). GROUP_M = 1 walks the tiles row by row; GROUP_M > 1 walks
    columns of GROUP_M row tiles, so consecutive programs share their A rows AND their B columns."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n               # programs in one band of GROUP_M row tiles
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)  # the last band may be shorter
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def epilogue(acc, offs_m, offs_n, M, N, bias_ptr, p, keep_scale, seed,
             HAS_BIAS: tl.constexpr, GELU: tl.constexpr, DROPOUT: tl.constexpr):
    """bias (one value per output column), tanh GELU, dropout: on the float32 tile, in registers."""
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    if GELU:
        acc = gelu_math(acc, True)
    if DROPOUT:
        # element (m, n) of the contiguous (M, N) output is number m * N + n: the same Philox numbers
        # as chapter 4's bias_gelu_dropout and dropout_keep_mask for that shape and seed
        idx = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        r = tl.rand(seed, idx)
        p, keep_scale = tl.cast(p, tl.float32), tl.cast(keep_scale, tl.float32)  # fp64 from torch.compile
        acc = tl.where(r >= p, acc * keep_scale, 0.0)
    return acc


@triton.jit
def tile_matmul(a_ptr, b_ptr, offs_m, offs_n, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The BLOCK_M x BLOCK_N tile of A @ B at rows offs_m and columns offs_n, summed in float32."""
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # C tile = sum over k0 of A[rows, k0:k0+BLOCK_K] @ B[k0:k0+BLOCK_K, cols]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        mask_k = k < K                                   # the last K tile is ragged: read zeros there
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + k[None, :] * stride_ak,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptr + k[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit(do_not_specialize=["seed"])
def matmul_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K,
                  stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                  p, keep_scale, seed,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr, GELU: tl.constexpr,
                  DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid = tl.program_id(axis=0)
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)   # int64: rows * stride may pass 2^31
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tile_matmul(a_ptr, b_ptr, offs_m, offs_n, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                      BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)
    acc = epilogue(acc, offs_m, offs_n, M, N, bias_ptr, p, keep_scale, seed, HAS_BIAS, GELU, DROPOUT)
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def tile_order(num_pid_m: int, num_pid_n: int, group_m: int) -> list[tuple[int, int]]:
    """(pid_m, pid_n) of programs 0, 1, 2, ...: :func:`grouped_tile` in Python, for tables and plots."""
    out = []
    for pid in range(num_pid_m * num_pid_n):
        in_group = group_m * num_pid_n
        first = (pid // in_group) * group_m
        size = min(num_pid_m - first, group_m)
        out.append((first + (pid % in_group) % size, (pid % in_group) // size))
    return out


# --------------------------------------------------------------------------------------------------
# Checking inputs (shared with course_utils.tuned.gemm)
# --------------------------------------------------------------------------------------------------
def check_operands(a, b, bias=None, p: float = 0.0, seed: int = 0):
    """Validate ``a @ b (+ bias)`` operands; return (M, N, K). Raises TypeError/ValueError."""
    for name, t in (("x", a), ("w", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if a.dtype != b.dtype:
        raise TypeError(f"x and w must share one dtype, got {a.dtype} and {b.dtype}")
    if a.dtype not in DTYPES:
        raise TypeError(f"dtype must be float16, bfloat16 or float32, got {a.dtype}")
    if a.device != b.device:
        raise ValueError(f"x and w must be on one device, got {a.device} and {b.device}")
    if a.device.type != env.DEVICE.type:
        raise ValueError(f"tensors must be on the {env.DEVICE.type} device in {env.MODE} mode, got {a.device}")
    if a.dtype == torch.bfloat16:
        if not env.on_gpu():
            raise TypeError("bfloat16 arithmetic is wrong under Triton's interpreter: use float16 or float32 on CPU")
        if not hardware.device_info().has_bf16:
            raise TypeError("this GPU has no bfloat16 (it needs sm_80 or newer): use float16")
    M, K = a.shape
    if b.shape[0] != K:
        raise ValueError(f"x is {M} x {K}, so w must have {K} rows (K x N), got shape {tuple(b.shape)}")
    N = b.shape[1]
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if bias.shape != (N,):
            raise ValueError(f"bias must have one value per output column, shape ({N},), got {tuple(bias.shape)}")
        if bias.dtype != a.dtype or bias.device != a.device:
            raise TypeError(f"bias must be {a.dtype} on {a.device}, got {bias.dtype} on {bias.device}")
        if bias.stride(0) != 1 and N > 1:
            raise ValueError("bias must be contiguous")
    if not 0.0 <= float(p) < 1.0:
        raise ValueError(f"dropout p must be in [0, 1), got {p}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an int in [0, 2^63), got {seed!r}")
    return M, N, K


def dot_precision(dtype: torch.dtype):
    """float32 inputs multiply in full precision ("ieee"), as torch.matmul does by default."""
    return "ieee" if dtype == torch.float32 else None


# --------------------------------------------------------------------------------------------------
# Launchers (v1, v2)
# --------------------------------------------------------------------------------------------------
def matmul_teaching(a, b, *, bias=None, gelu: bool = False, p: float = 0.0, seed: int = 0,
                    block_m: int = 32, block_n: int = 32, block_k: int = 32, group_m: int = 8,
                    num_warps: int = 4, num_stages: int = 2, out=None):
    """``dropout(gelu(a @ b + bias), p)`` by the teaching kernel, one launch; every part optional.

    ``a`` is M x K, ``b`` K x N, any strides; ``bias`` has N entries; ``group_m=1`` turns the grouped
    launch order off. The output is a new contiguous M x N tensor of the inputs' dtype (or ``out``).
    """
    M, N, K = check_operands(a, b, bias, p, seed)
    c = torch.empty((M, N), dtype=a.dtype, device=a.device) if out is None else out
    if c.shape != (M, N) or c.dtype != a.dtype:
        raise ValueError(f"out must be {M} x {N} {a.dtype}, got {tuple(c.shape)} {c.dtype}")
    if M == 0 or N == 0:
        return c
    if K == 0:  # an empty sum: the epilogue applied to zeros, without a launch
        return linear_gelu_ref(None, None, bias, gelu=gelu, p=p, seed=seed, _acc=torch.zeros_like(c), out=c)
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n),)
    matmul_kernel[grid](a, b, c, bias if bias is not None else c, M, N, K,
                        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
                        float(p), 1.0 / (1.0 - float(p)), seed,
                        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
                        HAS_BIAS=bias is not None, GELU=bool(gelu), DROPOUT=float(p) > 0.0,
                        DOT_PRECISION=dot_precision(a.dtype), num_warps=num_warps, num_stages=num_stages)
    return c


def linear_gelu_teaching(x, w, b, *, p: float = 0.0, seed: int = 0, **tiles):
    """``dropout(gelu(x @ w + b), p)`` (tanh GELU) in one launch of the teaching kernel (v2)."""
    return matmul_teaching(x, w, bias=b, gelu=True, p=p, seed=seed, **tiles)


# --------------------------------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------------------------------
def matmul_ref(a, b):
    return a @ b


def linear_gelu_ref(x, w, b, *, gelu: bool = True, p: float = 0.0, seed: int = 0, _acc=None, out=None):
    """The unfused chain: matmul (+ bias), then GELU, then dropout with the fused kernel's own mask.

    Half-precision products are rounded to the input dtype after the matmul, as cuBLAS + trailing
    kernels do; the float64 checks call it on float64 copies instead.
    """
    y = _acc if _acc is not None else x @ w
    if b is not None:
        y = y + b
    if gelu:
        y = F.gelu(y, approximate="tanh")
    if p > 0.0:
        y = y * dropout_keep_mask_teaching(y.shape, p, seed, device=y.device).to(y.dtype) / (1.0 - p)
    if out is not None:
        out.copy_(y)
        return out
    return y


def compile_cases(info):
    """The teaching launches ``python -m course_utils.aot`` compiles for ``info`` (tuned: tuned/gemm.py)."""
    from ..aot import dtype_name, dtypes_for, empty
    for dt in dtypes_for(info):
        name = dtype_name(dt)
        yield (f"matmul_teaching {name}",
               lambda dt=dt: matmul_teaching(empty(100, 72, dtype=dt), empty(72, 40, dtype=dt)))
        yield (f"linear_gelu_teaching {name} dropout, w transposed",
               lambda dt=dt: linear_gelu_teaching(empty(100, 72, dtype=dt), empty(40, 72, dtype=dt).T,
                                                  empty(40, dtype=dt), p=0.1, seed=1))
    # past 2^31 elements of x (nothing is allocated): the int64 row offsets compile
    yield "matmul_teaching 2^31+", lambda: matmul_teaching(empty(2**20 + 1, 2048, dtype=torch.float16),
                                                          empty(2048, 64, dtype=torch.float16))
