"""CUDA graphs (chapter 1): capture a callable once, replay it with one call from the host.

:func:`capture` is the helper the benchmarks use for launch-bound sizes: warm-up on a side stream
(compilation, lazy initialization and allocator growth happen there, not in the graph), capture,
then ``replay()``. On a GPU it uses ``torch.cuda.CUDAGraph``; under the interpreter it uses
:class:`SimulatedGraph`, a CPU stand-in that keeps a graph's rules, so the same code captures and
replays on a laptop. ``CUDAGraph`` and ``graph`` are torch's own on a GPU and the simulation on the
CPU (chapter 1 and exercise 1.2 use them directly).

What a capture cannot hold: a synchronization or a host read of device data (``.item()``, printing
a tensor, a data-dependent Python branch), and first-use work such as compiling a kernel or
initializing a library (hence the warm-up). Allocating inside the capture is allowed: the graph
keeps a private memory pool, so the tensors it made keep their addresses for every replay.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import env


class GraphCaptureError(RuntimeError):
    """A callable could not be captured into a graph; the message says what to change."""


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
        with torch.no_grad():   # a graph's kernels are not autograd's: neither is its poison nor its replay
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
        with _no_dispatch_modes(), torch.no_grad():
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
    from .profile import triton_launch_hook

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


@dataclass
class Graphed:
    """A captured callable: ``replay()`` re-runs every kernel it launched, on the same buffers, and
    returns ``output`` (the object the captured call returned, overwritten by each replay)."""

    graph: object
    output: object

    def replay(self):
        self.graph.replay()
        return self.output

    __call__ = replay


def capture(fn, *, warmup: int = 3, stream=None) -> Graphed:
    """Capture ``fn()`` (no arguments) into a graph and return it as a :class:`Graphed`.

    ``fn`` is first called ``warmup`` times on a side stream, then once under capture. To run on
    new data, copy it into the tensors ``fn`` reads (``x.copy_(new)``): a graph replays fixed
    addresses and shapes. ``stream``: the side stream for both (a ``torch.cuda.Stream``; ignored on the
    CPU), for work that must be warmed up and captured where it was built (DDP, say); default a new one.
    """
    if not callable(fn):
        raise TypeError(f"capture() needs a callable taking no arguments, got {type(fn).__name__}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
        raise ValueError(f"warmup must be an int >= 1 (compilation and lazy initialization must happen "
                         f"before the capture), got {warmup!r}")
    name = getattr(fn, "__qualname__", type(fn).__name__)
    side = None
    if env.on_gpu():
        side = stream or torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
    else:
        for _ in range(warmup):
            fn()
    g = CUDAGraph()
    try:
        with torch.cuda.graph(g, stream=side) if side is not None else graph(g):
            out = fn()
    except Exception as e:
        raise GraphCaptureError(
            f"capturing {name} into a graph failed ({type(e).__name__}: {e}). A graph cannot hold a "
            "synchronization or a host read of device data (.item(), print(tensor), a branch on a tensor's "
            "value), nor first-use work (compilation, library initialization): call it once before, or "
            "raise warmup.") from e
    return Graphed(g, out)
