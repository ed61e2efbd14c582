"""Launch overhead: the smallest kernels there are, chains of tiny ops, and CUDA graphs.

Chapter 1 measures what one launch costs when the kernel does (almost) nothing, then removes that
cost for a chain of small ops by capturing the chain once and replaying it.

Version ladder:
    v0 ``empty`` / ``empty10``: a Triton kernel with no body (1 or 10 arguments): launch cost alone
    v1 ``chain_ref(x, n_ops)``: n_ops tiny eager torch ops, n_ops launches from the host
    v2 ``add_one``: one tiny Triton kernel (one launch, masked)
    v3 a CUDA graph of the chain (``CUDAGraph`` + ``graph``): one replay call from the host for all
       n_ops kernels; on the CPU a :class:`SimulatedGraph` follows the same rules (static shapes,
       static addresses, outputs overwritten by every replay)

``CUDAGraph`` and ``graph`` are torch's own on a GPU and the simulation under the interpreter, so the
same code captures and replays on both; they live in :mod:`course_utils.graphs` (with
:func:`~course_utils.graphs.capture`, the helper the benchmarks use) and are importable from here.
"""

from __future__ import annotations

import time

import torch
import triton
import triton.language as tl

from .. import env
from ..graphs import CUDAGraph, SimulatedGraph, graph  # noqa: F401  (chapter 1 imports them from here)


@triton.jit
def empty_kernel(x_ptr):
    # No body: what this kernel costs is the launch itself.
    pass


@triton.jit
def empty10_kernel(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9):
    # Ten arguments, no body: each argument is one more thing the launcher packs per call.
    pass


@triton.jit
def add_one_kernel(x_ptr, y_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(axis=0)
    offsets = pid.to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask)
    tl.store(y_ptr + offsets, x + 1, mask=mask)


def _check_tensor(name: str, x, *, floating: bool = True) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.device.type != env.DEVICE.type:
        raise ValueError(f"{name} is on {x.device}, expected a tensor on {env.DEVICE} (cu.DEVICE)")
    if floating and x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"{name} has dtype {x.dtype}, expected float32, float16 or bfloat16")
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")


def empty(x: torch.Tensor) -> None:
    """Launch the empty kernel once (one program), passing ``x`` as its one argument."""
    _check_tensor("x", x, floating=False)
    empty_kernel[(1,)](x)


def empty10(*tensors: torch.Tensor) -> None:
    """Launch the 10-argument empty kernel once; pass exactly ten tensors."""
    if len(tensors) != 10:
        raise ValueError(f"empty10 takes exactly 10 tensors, got {len(tensors)}")
    for i, t in enumerate(tensors):
        _check_tensor(f"tensor {i}", t, floating=False)
    empty10_kernel[(1,)](*tensors)


def add_one(x: torch.Tensor, out: torch.Tensor | None = None, BLOCK_SIZE: int = 1024) -> torch.Tensor:
    """``x + 1`` in one Triton launch (a tiny kernel when ``x`` is small)."""
    _check_tensor("x", x)
    if out is None:
        out = torch.empty_like(x)
    else:
        _check_tensor("out", out)
        if out.shape != x.shape or out.dtype != x.dtype:
            raise ValueError(f"out must match x: expected {tuple(x.shape)} {x.dtype}, "
                             f"got {tuple(out.shape)} {out.dtype}")
    n = x.numel()
    if n == 0:
        return out
    grid = (triton.cdiv(n, BLOCK_SIZE),)
    add_one_kernel[grid](x, out, n, BLOCK_SIZE=BLOCK_SIZE)
    return out


def add_one_ref(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def chain_ref(x: torch.Tensor, n_ops: int) -> torch.Tensor:
    """``n_ops`` tiny eager ops in a row (``y = y * 0.5 + ...`` alternating), one launch each."""
    if not isinstance(n_ops, int) or n_ops < 1:
        raise ValueError(f"n_ops must be a positive int, got {n_ops!r}")
    _check_tensor("x", x)
    y = x
    for i in range(n_ops):
        y = y * 0.5 if i % 2 else y + 1.0
    return y


def host_us_per_call(fn, calls: int = 1000, warmup: int = 20) -> float:
    """Microseconds per call of ``fn()`` called back to back, read from the host clock.

    Warm up (compilation, caches), synchronize, time ``calls`` calls, synchronize again before reading
    the clock: for tiny ops this is the launch rate the host sustains, which is what a model made of
    many small kernels pays. On the CPU it times the CPU (nothing is asynchronous there).
    """
    if calls < 1 or warmup < 0:
        raise ValueError(f"calls must be >= 1 and warmup >= 0, got calls={calls}, warmup={warmup}")
    sync = torch.cuda.synchronize if env.on_gpu() else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - t0) / calls * 1e6


def compile_cases(info):
    """The launches the compile matrix compiles for ``info`` (see course_utils/aot.py)."""
    from ..aot import dtype_name, dtypes_for
    from ..aot import empty as e  # a CPU tensor (not this module's empty())

    yield "empty", lambda: empty(e(16))
    yield "empty10", lambda: empty10(*[e(16) for _ in range(10)])
    for dt in dtypes_for(info):
        yield f"add_one {dtype_name(dt)}", lambda dt=dt: add_one(e(1000, dtype=dt))
