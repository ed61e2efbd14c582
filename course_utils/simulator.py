"""A simulated GPU: the timing protocol taught, tested and graded on a CPU.

:class:`SimulatedGPU` has the interface :func:`course_utils.timing.time_ms` uses; its kernels
(:class:`SimKernel`) and events (:class:`SimEvent`) advance a model clock, so every mistake of
chapter 8 gives its wrong number deterministically. (The CUDA-graph stand-in ``SimulatedGraph``
lives in :mod:`course_utils.graphs`.)
"""

from __future__ import annotations

import random

from .timing import L2_FLUSH_BYTES


class SimulatedGPU:
    """A toy GPU with a host clock, an asynchronous queue, JIT compilation, an L2 cache and noise.

    It has the interface :func:`time_ms` uses (``synchronize``, ``Event``, ``flush_l2``, ``graph``)
    plus ``host_time()`` (a host clock in ms, like ``time.perf_counter() * 1e3``), and
    ``kernel(nbytes)`` makes a kernel that moves ``nbytes``. Nothing really runs; time only
    advances in the model, so each mistake of chapter 8 gives its wrong number deterministically:
    reading the host clock without a sync measures the queue, the first call includes compilation,
    a working set that stays in L2 runs at L2 speed, a few repetitions are slowed down by
    ``spike`` (the mean moves, the median does not), and every launch costs ``launch_us`` on the host.
    """

    def __init__(self, *, hbm_gbps: float = 3000.0, l2_gbps: float = 9000.0, l2_bytes: int = 50 * 2**20,
                 launch_us: float = 8.0, latency_us: float = 2.0, jit_ms: float = 150.0,
                 noise: float = 0.01, spike_prob: float = 0.1, spike: float = 3.0, sync_us: float = 5.0,
                 seed: int = 0):
        if min(hbm_gbps, l2_gbps, l2_bytes) <= 0:
            raise ValueError("bandwidths and the L2 size must be positive")
        self.hbm_gbps, self.l2_gbps, self.l2_bytes = hbm_gbps, l2_gbps, l2_bytes
        self.launch_us, self.latency_us, self.jit_ms, self.sync_us = launch_us, latency_us, jit_ms, sync_us
        self.noise, self.spike_prob, self.spike = noise, spike_prob, spike
        self._rng = random.Random(seed)
        self._host = 0.0        # ms
        self._queue_end = 0.0   # ms: when the GPU finishes what is queued
        self._cached: dict[int, int] = {}  # kernel id -> bytes resident in L2 (insertion order = LRU)
        self._ran: dict[int, list[float]] = {}  # kernel id -> the duration of each of its runs (ms)
        self._capturing: list | None = None
        self.kernels: list[SimKernel] = []
        self.launches = 0
        self.flushes = 0
        self.syncs = 0
        self.host_reads = 0
        self.events = 0

    # host side
    def host_time(self) -> float:
        """The host's clock in milliseconds (what ``time.perf_counter()`` would read)."""
        self.host_reads += 1
        return self._host

    def synchronize(self) -> None:
        """Wait until the GPU has finished everything queued."""
        self.syncs += 1
        self._host = max(self._host, self._queue_end) + self.sync_us * 1e-3

    def Event(self, enable_timing: bool = True) -> SimEvent:  # noqa: N802  (mirrors torch.cuda.Event)
        self.events += 1
        return SimEvent(self)

    def kernel(self, nbytes: int, name: str = "") -> SimKernel:
        """A kernel that moves ``nbytes`` through DRAM (or L2, when they are still there)."""
        if int(nbytes) != nbytes or nbytes <= 0:
            raise ValueError(f"nbytes must be a positive integer, got {nbytes!r}")
        k = SimKernel(self, int(nbytes), name or f"kernel{len(self.kernels)}")
        self.kernels.append(k)
        return k

    def true_ms(self, k: SimKernel) -> float:
        """What a correct benchmark of ``k`` reports: cold L2, no launch overhead, no noise."""
        return self.latency_us * 1e-3 + k.nbytes / (self.hbm_gbps * 1e9) * 1e3

    def flush_l2(self) -> None:
        """Queue a kernel that writes a buffer larger than L2 (like :func:`time_ms`), evicting everything.

        It takes long enough that the host has launched the next kernel before it ends, so the
        launch overhead stays out of the event-timed region, as on a real GPU.
        """
        flush_bytes = max(L2_FLUSH_BYTES, 2 * self.l2_bytes)
        self._enqueue(flush_bytes / (self.hbm_gbps * 1e9) * 1e3, launch=True)
        self._cached.clear()
        self.flushes += 1

    def graph(self, fn):
        """Capture ``fn``'s launches once; replaying them costs one launch on the host."""
        self._capturing = []
        try:
            fn()
        finally:
            captured, self._capturing = self._capturing, None

        def replay():
            self._host += self.launch_us * 1e-3
            for k in captured:
                self._enqueue(k._duration(), launch=False)
        return replay

    # device side
    def _enqueue(self, ms: float, launch: bool = True) -> None:
        if launch:
            self._host += self.launch_us * 1e-3
        start = max(self._host, self._queue_end)
        self._queue_end = start + ms


class SimKernel:
    """A kernel of :class:`SimulatedGPU`: calling it launches it (asynchronously)."""

    def __init__(self, gpu: SimulatedGPU, nbytes: int, name: str):
        self.gpu, self.nbytes, self.__name__ = gpu, nbytes, name
        self.compiled = False
        self.calls = 0

    def _duration(self) -> float:
        g = self.gpu
        warm = self.nbytes <= g.l2_bytes and id(self) in g._cached
        bw = g.l2_gbps if warm else g.hbm_gbps
        ms = g.latency_us * 1e-3 + self.nbytes / (bw * 1e9) * 1e3
        ms *= 1 + g.noise * g._rng.gauss(0, 1)
        if g._rng.random() < g.spike_prob:
            ms *= g.spike
        # what it touched is now in L2 (a working set larger than L2 leaves nothing useful there)
        g._cached.pop(id(self), None)
        if self.nbytes <= g.l2_bytes:
            g._cached[id(self)] = self.nbytes
            while sum(g._cached.values()) > g.l2_bytes:
                g._cached.pop(next(iter(g._cached)))
        else:
            g._cached.clear()
        g._ran.setdefault(id(self), []).append(max(ms, 1e-6))
        return max(ms, 1e-6)

    def __call__(self):
        g = self.gpu
        self.calls += 1
        if not self.compiled:
            g._host += g.jit_ms  # the first call compiles, on the host
            self.compiled = True
        if g._capturing is not None:
            g._capturing.append(self)
            return None
        g.launches += 1
        g._enqueue(self._duration())
        return None


class SimEvent:
    """Like ``torch.cuda.Event``: ``record()`` marks the queue, ``elapsed_time`` needs both done."""

    def __init__(self, gpu: SimulatedGPU):
        self.gpu = gpu
        self.t: float | None = None

    def record(self) -> None:
        self.t = max(self.gpu._host, self.gpu._queue_end)

    def query(self) -> bool:
        return self.t is not None and self.gpu._host >= self.t

    def synchronize(self) -> None:
        if self.t is None:
            raise RuntimeError("event was never recorded")
        self.gpu._host = max(self.gpu._host, self.t)

    def elapsed_time(self, end: SimEvent) -> float:
        if self.t is None or end.t is None:
            raise RuntimeError("elapsed_time: both events must be recorded first")
        if not (self.query() and end.query()):
            raise RuntimeError("elapsed_time: the events have not completed yet; call synchronize() "
                               "first (CUDA raises 'device not ready' here)")
        return end.t - self.t



__all__ = ["SimulatedGPU", "SimKernel", "SimEvent"]
