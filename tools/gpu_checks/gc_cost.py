"""Whether Python's cyclic garbage collector costs chapter 12's steps host time (issue 27).

In the recorded B=8 runs the autograd steps spread widely between their 20th and 80th percentiles while the
step by hand, the same kernels without the autograd engine, ran steadily. A collection of the oldest
generation walks every object the process keeps (the models, their tensors, torch's own), and one can fall
inside any step. This times versions of the step back to back, every thread on one core, in three
garbage-collector settings, interleaved round by round:

- ``on``: Python's default (what every recorded run used);
- ``frozen``: ``gc.freeze()`` after the versions are built (the objects alive then are never scanned again;
  collections still run, over what the steps allocate);
- ``off``: ``gc.disable()`` while timing (nothing collected; a step that leaked cycles would grow).

For each version and setting: ms a step (median and spread over the rounds), collections per step by
generation and the milliseconds they took (``gc.callbacks``), and the objects the collector tracks.

    python tools/gpu_checks/gc_cost.py [--config gpt2-b8] [--rounds 5] [--steps 10]
"""

from __future__ import annotations

import gc
import statistics
import time

import torch

from benchmarks import training as T
from course_utils import affinity, gpt

VERSIONS = ("eager", "torch.compile", "course", "course, backward on the calling thread", "course, step by hand")
SETTINGS = ("on", "frozen", "off")


class GcClock:
    """Collections (by generation) and seconds spent collecting, from ``gc.callbacks``."""

    def __init__(self):
        self.count = [0, 0, 0]
        self.seconds = 0.0
        self._t = None

    def __call__(self, phase, info):
        if phase == "start":
            self._t = time.perf_counter()
        elif self._t is not None:
            self.seconds += time.perf_counter() - self._t
            self.count[info["generation"]] += 1
            self._t = None

    def reset(self):
        self.count, self.seconds = [0, 0, 0], 0.0


def timed(step, steps: int, setting: str, clock: GcClock) -> tuple[float, float, list[int]]:
    """(ms a step, GC ms a step, collections by generation) over ``steps`` steps back to back."""
    if setting == "off":
        gc.disable()
    torch.cuda.synchronize()
    clock.reset()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t) / steps * 1e3
    gc.enable()
    return ms, clock.seconds / steps * 1e3, list(clock.count)


def main():
    a, cfg, batch = T.round_args(rounds=5)
    data = gpt.tokens()
    steps = {}
    for name in VERSIONS:
        steps[name] = T.build(name, cfg, data, batch=batch)
        print(f"built {name}", flush=True)
    clock = GcClock()
    gc.callbacks.append(clock)
    print(f"gc thresholds {gc.get_threshold()}, objects tracked after the builds: {len(gc.get_objects())}")
    results = {(n, s): [] for n in VERSIONS for s in SETTINGS}
    with affinity.one_core() as core:
        print(f"every thread on core {core} ({affinity.LAST_CHOICE})", flush=True)
        for r in range(a.rounds):
            for setting in SETTINGS:
                if setting == "frozen":
                    gc.freeze()
                for name in VERSIONS:
                    results[name, setting].append(timed(steps[name], a.steps, setting, clock))
                if setting == "frozen":
                    gc.unfreeze()
            print(f"round {r + 1} of {a.rounds} done", flush=True)
    gc.callbacks.remove(clock)
    print(f"\n{a.config}, {a.rounds} rounds x {a.steps} steps, {torch.cuda.get_device_name()}")
    print(f"{'version':40} {'gc':7} {'ms med':>7} {'min':>7} {'max':>7} {'gc ms':>6}  collections/step g0 g1 g2")
    for name in VERSIONS:
        for setting in SETTINGS:
            rs = results[name, setting]
            ms = [x[0] for x in rs]
            gcms = statistics.median(x[1] for x in rs)
            per = [sum(x[2][g] for x in rs) / (len(rs) * a.steps) for g in range(3)]
            print(f"{name:40} {setting:7} {statistics.median(ms):7.2f} {min(ms):7.2f} {max(ms):7.2f} {gcms:6.2f}  "
                  f"{per[0]:.2f} {per[1]:.2f} {per[2]:.3f}")


if __name__ == "__main__":
    main()
