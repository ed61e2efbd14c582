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
same code captures and replays on both.
"""

from __future__ import annotations

import contextlib
import time

import torch
import triton
import triton.language as tl
from torch.utils._python_dispatch import TorchDispatchMode

from .. import env


@triton.jit
def _empty_kernel(x_ptr):
    # No body: what this kernel costs is the launch itself.
    pass


@triton.jit
def _empty_kernel_10(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9):
    # Ten arguments, no body: each argument is one more thing the launcher packs per call.
    pass


@triton.jit
def _add_one_kernel(x_ptr, y_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
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
    _empty_kernel[(1,)](x)


def empty10(*tensors: torch.Tensor) -> None:
    """Launch the 10-argument empty kernel once; pass exactly ten tensors."""
    if len(tensors) != 10:
        raise ValueError(f"empty10 takes exactly 10 tensors, got {len(tensors)}")
    for i, t in enumerate(tensors):
        _check_tensor(f"tensor {i}", t, floating=False)
    _empty_kernel_10[(1,)](*tensors)


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
    _add_one_kernel[grid](x, out, n, BLOCK_SIZE=BLOCK_SIZE)
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


# --- CUDA graphs, and their simulation on the CPU -------------------------------------------------

def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    return []


class _Recorder(TorchDispatchMode):
    def __init__(self, tape: list):
        super().__init__()
        self.tape = tape
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.paused:
            self.tape.append(("aten", func, args, kwargs, out))
        return out


class SimulatedGraph:
    """A CPU stand-in for ``torch.cuda.CUDAGraph`` that keeps its rules.

    Capturing records every torch operator and Triton launch with the tensors it used (the same
    objects, so the same addresses); the recorded outputs are then poisoned with NaN, because a real
    capture runs nothing. ``replay()`` re-runs the tape on those same tensors and writes each result
    into the tensor recorded at capture. So, as on a GPU: new values copied *into* a captured input
    are seen, a new tensor (new address) or a new shape is not, and every replay overwrites the same
    output tensor. (Unlike a capture on a GPU, the ops do run once while they are recorded.)
    """

    def __init__(self):
        self._tape: list | None = None
        self._capturing = False

    @contextlib.contextmanager
    def _capture(self):
        if self._capturing or self._tape is not None:
            raise RuntimeError("this graph is already captured: make a new CUDAGraph() to capture again")
        tape: list = []
        recorder = _Recorder(tape)
        self._capturing = True
        try:
            with _recording_triton(tape, recorder), recorder:
                yield self
        finally:
            self._capturing = False
        self._tape = tape
        for entry in tape:  # tensors made inside the capture hold garbage until the first replay
            if entry[0] == "aten":
                args = {id(a) for a in _tensors(entry[2]) + _tensors(list(entry[3].values()))}
                for t in _tensors(entry[4]):
                    if id(t) not in args and t.is_floating_point():
                        t.fill_(float("nan"))

    def replay(self) -> None:
        if self._tape is None:
            raise RuntimeError("replay() before capture: capture the graph first (with graph(g): ...)")
        # One replay is one call from the host, as on a GPU: profilers and launch counters see none
        # of the recorded ops one by one.
        with _no_dispatch_modes():
            self._run_tape()

    def _run_tape(self) -> None:
        for entry in self._tape:
            if entry[0] == "triton":
                _, run, kernel, args, kwargs = entry
                run(kernel, *args, **kwargs)
                continue
            _, func, args, kwargs, out = entry
            fresh = func(*args, **kwargs)
            for old, new in zip(_tensors(out), _tensors(fresh), strict=True):
                if old is not new:
                    old.copy_(new)


def _no_dispatch_modes():
    try:
        from torch.utils._python_dispatch import _disable_current_modes
    except ImportError:  # pragma: no cover - older torch
        return contextlib.nullcontext()
    return _disable_current_modes()


def _recording_triton(tape: list, recorder: _Recorder):
    from ..profile import triton_launch_hook

    return triton_launch_hook(
        lambda original, kernel, args, kwargs: tape.append(("triton", original, kernel, args, kwargs)), recorder)


CUDAGraph = torch.cuda.CUDAGraph if env.on_gpu() else SimulatedGraph


def graph(g):
    """``with graph(g): ...`` captures into ``g``: ``torch.cuda.graph`` on a GPU, simulated on the CPU."""
    if isinstance(g, SimulatedGraph):
        return g._capture()
    if isinstance(g, torch.cuda.CUDAGraph):
        return torch.cuda.graph(g)
    raise TypeError(f"graph() takes a CUDAGraph() made by this module, got {type(g).__name__}")
