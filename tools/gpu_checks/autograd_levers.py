"""How much of the autograd step's host time each lever takes back (issue 27): GPT-2 small, chapter 12's
versions timed back to back in interleaved rounds, every thread on the fastest core (re-probed each round).

- ``step by hand``: no autograd engine (the floor of these kernels from Python);
- ``one node a block``: the benchmark's ``course`` (``course-blocks``), the backward on the engine's GPU
  worker thread, and ``... calling thread`` (``torch.autograd.set_multithreading_enabled(False)``);
- ``one node the model``: :class:`course_utils.step.OneNode`, the whole model one autograd node (the step by
  hand behind autograd's interface), on the worker thread and on the calling thread;
- ``torch.compile``: the torch version compiled, the target.

Prints ms a step per version (median, min, max over the rounds) and GPU-busy ms (one profiled step).

    python tools/gpu_checks/autograd_levers.py [--config gpt2-b8] [--rounds 7] [--steps 10]
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch

from benchmarks import training as T
from course_utils import affinity, gpt, profile
from course_utils.step import OneNode


def _one_node_calling_thread(cfg, data, batch: int):
    """The benchmark's ``course, one autograd node the model`` with the backward on the calling thread."""
    model = T._model(cfg, "course")
    opt = gpt.optimizer(model)
    one = OneNode(model)
    x, y = T._batch(cfg, data, batch=batch)

    def step():
        with torch.autograd.set_multithreading_enabled(False):
            return gpt.train_step(one, opt, x, y)
    for _ in range(3):
        step()
    return step


def build(cfg, data, batch: int) -> dict:
    steps = {"step by hand": T.build("course, step by hand", cfg, data, batch=batch),
             "one node a block": T.build("course", cfg, data, batch=batch),
             "one node a block, calling thread": T.build("course, backward on the calling thread", cfg, data,
                                                         batch=batch),
             "one node the model": T.build("course, one autograd node the model", cfg, data, batch=batch),
             "one node the model, calling thread": _one_node_calling_thread(cfg, data, batch),
             "torch.compile": T.build("torch.compile", cfg, data, batch=batch)}
    return steps


def main():
    a, cfg, batch = T.round_args(rounds=7)
    steps = build(cfg, gpt.tokens(), batch)
    times = {n: [] for n in steps}
    for r in range(a.rounds):
        with affinity.one_core() as core:
            for name, step in steps.items():
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(a.steps):
                    step()
                torch.cuda.synchronize()
                times[name].append((time.perf_counter() - t) / a.steps * 1e3)
        print(f"round {r + 1}: core {core}, loop {affinity.LAST_CHOICE.get('loop_us', float('nan')):.0f} us "
              f"(median core {affinity.LAST_CHOICE.get('median_us', float('nan')):.0f})", flush=True)
    busy = {}
    for name, step in steps.items():
        with contextlib.suppress(Exception):
            busy[name] = profile.step_kernels(step, steps=2)["us"].sum() / 2 / 1e3
    print(f"\n{a.config} on {torch.cuda.get_device_name()}: ms a step over {a.rounds} rounds x {a.steps} steps")
    print(f"{'version':38} {'median':>7} {'min':>7} {'max':>7} {'GPU-busy':>8} {'/ compile':>9}")
    ref = statistics.median(times["torch.compile"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:38} {med:7.2f} {min(ts):7.2f} {max(ts):7.2f} {busy.get(name, float('nan')):8.2f} "
              f"{ref / med:9.3f}")


if __name__ == "__main__":
    main()
