"""Does the benchmark's process slow chapter 12's autograd step down? (issue 27: the B=8 host gap)

``make bench``'s training topic builds all thirteen versions of the step in one process and times them
in interleaved rounds. There the course's autograd step took 29.1 ms at B=8 against 18.8 for the step by
hand, with the same 488 launches; in a process of its own (``host_profile.py``) the same step needed
only 17.6 ms of host time. This script times a few versions three times in one process:

1. ``alone``: only those versions built;
2. ``all built``: after every version of the benchmark is built too (compiled graphs, CUDA graphs);
3. ``gc frozen``: the same, after ``gc.collect(); gc.freeze()`` (the objects built so far are left out
   of every later collection).

Per version and state: the wall time of steps back to back, the host time to issue one step from an
idle GPU (``host``) and while the GPU still runs the steps before it (``busy``: the host's time when it
cannot get ahead, as back to back in the benchmark), and the time spent in Python's garbage collector
per step (``gc.callbacks``), by generation.
Last, per version in the ``all built`` state, the CUDA runtime calls of one step (torch.profiler),
so a blocking one (``cudaFree``, ``cudaStreamSynchronize``, ``cudaEventSynchronize``) shows.

    python tools/gpu_checks/step_process.py [--config gpt2-b8] [--steps 20]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import threading
import time
from collections import defaultdict

import torch

from benchmarks import training as T
from course_utils import gpt

#: the versions timed in each state
TIMED = ("eager", "eager, backward on the calling thread", "course", "course, backward on the calling thread",
         "course, step by hand")


class GcClock:
    """Milliseconds spent in the garbage collector, by generation, since the last ``reset``."""

    def __init__(self):
        self.ms, self.count, self._t0 = defaultdict(float), defaultdict(int), None
        gc.callbacks.append(self._on)

    def _on(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.ms[info["generation"]] += (time.perf_counter() - self._t0) * 1e3
            self.count[info["generation"]] += 1
            self._t0 = None

    def reset(self):
        self.ms.clear()
        self.count.clear()


def _wall(step, n: int) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


def _host_busy(step, n: int) -> float:
    """Median host ms of one step issued while the GPU is still busy with the steps before it."""
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        step()
        times.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def time_state(state: str, steps: dict, n: int, clock: GcClock) -> list[tuple]:
    rows = []
    for name in TIMED:
        clock.reset()
        wall = _wall(steps[name], n)
        per = {g: clock.ms[g] / n for g in (0, 1, 2)}
        counts = {g: clock.count[g] for g in (0, 1, 2)}
        host = T.host_ms(steps[name], n)
        busy = _host_busy(steps[name], n)
        rows.append((state, name, wall, host, busy, per, counts))
    return rows


def runtime_calls(step, steps: int = 3) -> list[tuple]:
    """(name, calls per step, host ms per step, longest ms) of every CUDA runtime/driver call in ``steps`` steps."""
    from torch.profiler import ProfilerActivity, profile
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    agg = defaultdict(lambda: [0, 0.0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith(("cuda", "cu")):
            a = agg[e.name]
            a[0] += 1
            dur = e.time_range.elapsed_us() / 1e3
            a[1] += dur
            a[2] = max(a[2], dur)
    return sorted(((k, v[0] / steps, v[1] / steps, v[2]) for k, v in agg.items()), key=lambda r: -r[2])


def engine_threads(step) -> dict:
    """Where one step's backward nodes ran: per thread, the nodes evaluated and their ms; and the idle time
    between one node's end and the next one's start (on any thread), in total and the longest gap."""
    from torch.profiler import ProfilerActivity, profile
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
        torch.cuda.synchronize()
    nodes = sorted((e for e in prof.events() if e.name.startswith("autograd::engine::evaluate_function")),
                   key=lambda e: e.time_range.start)
    per = defaultdict(lambda: [0, 0.0])
    for e in nodes:
        per[e.thread][0] += 1
        per[e.thread][1] += e.time_range.elapsed_us() / 1e3
    gaps = [max(0.0, b.time_range.start - a.time_range.end) / 1e3 for a, b in zip(nodes, nodes[1:])]
    switches = sum(a.thread != b.thread for a, b in zip(nodes, nodes[1:]))
    span = (nodes[-1].time_range.end - nodes[0].time_range.start) / 1e3 if nodes else 0.0
    return {"per_thread": dict(per), "gap_ms": sum(gaps), "longest_gap_ms": max(gaps, default=0.0),
            "switches": switches, "span_ms": span, "nodes": len(nodes)}


def chain_backward(nodes: int, threads: bool, n: int = 20) -> float:
    """Host ms of the backward alone of a chain of ``nodes`` tiny multiplications on the GPU (one node each)."""
    x = torch.randn(64, device="cuda", requires_grad=True)
    times = []
    with torch.autograd.set_multithreading_enabled(threads):
        for _ in range(n):
            y = x
            for _ in range(nodes):
                y = y * 1.0001
            loss = y.sum()
            torch.cuda.synchronize()
            t = time.perf_counter()
            loss.backward()
            times.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="gpt2-b8")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--alone-only", action="store_true", help="only the first state (no other version built)")
    a = ap.parse_args()
    cfg, batch, _ = T.CONFIGS[a.config]
    data = gpt.tokens()
    clock = GcClock()
    t0 = time.perf_counter()
    steps = {name: T.build(name, cfg, data, batch=batch) for name in TIMED}
    print(f"[{time.perf_counter() - t0:6.1f} s] built {len(steps)} versions; "
          f"{len(gc.get_objects())} objects tracked by gc", flush=True)
    rows = time_state("alone", steps, a.steps, clock)
    if not a.alone_only:
        for name in T.IMPLS:
            if name not in steps:
                steps[name] = T.build(name, cfg, data, batch=batch)
        print(f"[{time.perf_counter() - t0:6.1f} s] built all {len(steps)}; {len(gc.get_objects())} objects tracked",
              flush=True)
        rows += time_state("all built", steps, a.steps, clock)
        gc.collect()
        gc.freeze()
        rows += time_state("gc frozen", steps, a.steps, clock)
        gc.unfreeze()
    print(f"\n=== {a.config}: ms per step; gc = ms per step in the collector (collections in {a.steps} steps)")
    head = ("state", "version", "wall", "host", "busy", "gc0", "gc1", "gc2")
    print(f"{head[0]:10s} {head[1]:40s} " + " ".join(f"{h:>7}" for h in head[2:]) + "  collections 0/1/2")
    for state, name, wall, host, busy, per, counts in rows:
        print(f"{state:10s} {name:40s} {wall:7.2f} {host:7.2f} {busy:7.2f} "
              f"{per[0]:7.2f} {per[1]:7.2f} {per[2]:7.2f}  "
              f"{counts[0]}/{counts[1]}/{counts[2]}")
    for k in (1, 100, 400):
        on, off = chain_backward(k, True), chain_backward(k, False)
        print(f"backward of a chain of {k:3d} tiny GPU nodes: {on:7.3f} ms on the engine's thread, "
              f"{off:7.3f} ms on the calling thread")
    names = [t.name for t in threading.enumerate()]
    print(f"\nPython threads: {names}; GIL switch interval {sys.getswitchinterval()} s")
    print("\n=== the backward's nodes, one step under torch.profiler: threads, node ms, gaps between nodes")
    for name in ("eager", "eager, backward on the calling thread", "course", "course, backward on the calling thread"):
        r = engine_threads(steps[name])
        threads = ", ".join(f"thread {t}: {n} nodes {ms:.2f} ms" for t, (n, ms) in r["per_thread"].items())
        print(f"{name:40s} span {r['span_ms']:7.2f} ms, gaps {r['gap_ms']:6.2f} ms "
              f"(longest {r['longest_gap_ms']:.3f}), {r['switches']} thread switches; {threads}")
    for name in ("course", "course, step by hand"):
        print(f"\n=== CUDA runtime calls of one step of {name!r} : per step, by longest single call")
        print(f"{'call':40s} {'calls':>7} {'ms/step':>8} {'longest ms':>10}")
        for call, n, ms, longest in runtime_calls(steps[name])[:12]:
            print(f"{call:40s} {n:7.1f} {ms:8.3f} {longest:10.3f}")


if __name__ == "__main__":
    main()
