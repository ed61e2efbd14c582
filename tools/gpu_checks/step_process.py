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
idle GPU, and the time spent in Python's garbage collector per step (``gc.callbacks``), by generation.
Last, per version in the ``all built`` state, the CUDA runtime calls of one step (torch.profiler),
so a blocking one (``cudaFree``, ``cudaStreamSynchronize``, ``cudaEventSynchronize``) shows.

    python tools/gpu_checks/step_process.py [--config gpt2-b8] [--steps 20]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections import defaultdict

import torch

from benchmarks import training as T
from course_utils import gpt

#: the versions timed in each state
TIMED = ("eager", "course", "course, backward on the calling thread", "course, step by hand")


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


def _host(step, n: int) -> float:
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
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
        host = _host(steps[name], n)
        rows.append((state, name, wall, host, per, counts))
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
            dur = e.cpu_time_range.elapsed_us() / 1e3
            a[1] += dur
            a[2] = max(a[2], dur)
    return sorted(((k, v[0] / steps, v[1] / steps, v[2]) for k, v in agg.items()), key=lambda r: -r[2])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="gpt2-b8")
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    cfg, batch, _ = T.CONFIGS[a.config]
    data = gpt.tokens()
    clock = GcClock()
    t0 = time.perf_counter()
    steps = {name: T.build(name, cfg, data, batch=batch) for name in TIMED}
    print(f"[{time.perf_counter() - t0:6.1f} s] built {len(steps)} versions; "
          f"{len(gc.get_objects())} objects tracked by gc", flush=True)
    rows = time_state("alone", steps, a.steps, clock)
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
    print(f"{'state':10s} {'version':40s} {'wall':>7} {'host':>7} {'gc0':>6} {'gc1':>6} {'gc2':>6}  collections 0/1/2")
    for state, name, wall, host, per, counts in rows:
        print(f"{state:10s} {name:40s} {wall:7.2f} {host:7.2f} {per[0]:6.2f} {per[1]:6.2f} {per[2]:6.2f}  "
              f"{counts[0]}/{counts[1]}/{counts[2]}")
    for name in ("course", "course, step by hand"):
        print(f"\n=== CUDA runtime calls of one step of {name!r} (all built): per step, by longest single call")
        print(f"{'call':40s} {'calls':>7} {'ms/step':>8} {'longest ms':>10}")
        for call, n, ms, longest in runtime_calls(steps[name])[:12]:
            print(f"{call:40s} {n:7.1f} {ms:8.3f} {longest:10.3f}")


if __name__ == "__main__":
    main()
