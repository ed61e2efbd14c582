"""Which calls in chapter 12's training step make the host wait for the GPU (torch's sync debug mode).

A step whose host waits for the GPU cannot issue the next kernels while the GPU runs: on a host-bound step
that costs the whole of the host's time again. Prints, per version, each synchronizing call's place, then
what torch's sync debug mode cannot see: the caching allocator's cudaMalloc / cudaFree calls (a cudaFree
waits for the device) and Dynamo's compiles during ``STEPS`` steps, and the step's time (host queue, then
the wait for the GPU).

    python tools/gpu_checks/step_syncs.py [--config gpt2-b8] [--versions "course + torch.compile;torch.compile"]
    python tools/gpu_checks/step_syncs.py --all-built --rounds --versions "..."   # + the benchmark's timing loop

``--rounds`` then times the named versions as benchmarks.training does (bench.time_rounds: 3 interleaved rounds,
2 warm-up and 10 timed steps each, no L2 flush, every thread moved to the fastest core before each round): with
every version named it should reproduce the benchmark's rows; with fewer, it says which company slows a version.
"""

from __future__ import annotations

import argparse
import contextlib
import time
import traceback
import warnings

import torch

from benchmarks import training as T
from course_utils import affinity, gpt


def syncs_of(step) -> list[str]:
    step()
    torch.cuda.synchronize()
    places = []
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
        for w in caught:
            if "synchroniz" in str(w.message):
                places.append(f"{w.filename}:{w.lineno}: {str(w.message)[:90]}")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return places


STEPS = 10
DEFAULT_VERSIONS = "eager;course;course, one autograd node an op;course, step by hand"
ALLOCATOR = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def hidden_waits(step, steps: int = STEPS) -> str:
    """The allocator's device calls and Dynamo's frame compiles over ``steps`` steps, and the time a step
    takes to queue (host) and to finish (host + the wait for the GPU), in ms."""
    from torch._dynamo.utils import counters
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    frames = dict(counters["frames"])
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    queued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    after = torch.cuda.memory_stats()
    grew = {k: after.get(k, 0) - before.get(k, 0) for k in ALLOCATOR}
    compiled = {k: v - frames.get(k, 0) for k, v in counters["frames"].items() if v != frames.get(k, 0)}
    return (f"per step: queued {1e3 * (queued - t0) / steps:.2f} ms, done {1e3 * (done - t0) / steps:.2f} ms; "
            f"over {steps} steps: allocator {grew}, Dynamo frames {compiled or 'none'}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="gpt2-b8")
    ap.add_argument("--versions", default=DEFAULT_VERSIONS, help="';'-separated names of benchmarks.training.IMPLS")
    ap.add_argument("--all-built", action="store_true",
                    help="build every version first and keep them all, as the benchmark's process does")
    ap.add_argument("--rounds", action="store_true", help="then time the versions in the benchmark's loop")
    a = ap.parse_args()
    cfg, batch, _ = T.CONFIGS[a.config]
    data = gpt.tokens()
    one = torch.ones(1, device="cuda")
    control = syncs_of(lambda: one.sum().item())   # a step that reads a GPU value on the host must be caught
    print(f"=== control (one .item()): {len(control)} synchronizing call(s) caught")
    if not control:
        raise SystemExit("the sync debug mode caught nothing in the control: the counts below would mean nothing")
    built = {n: T.build(n, cfg, data, batch=batch) for n in T.IMPLS} if a.all_built else {}
    if built:
        gib = torch.cuda.memory_reserved() / 2**30
        print(f"=== every version built and kept ({len(built)}); {gib:.1f} GiB reserved")
    for name in a.versions.split(";"):
        try:
            step = built.get(name) or T.build(name, cfg, data, batch=batch)
            places = syncs_of(step)
            hidden = hidden_waits(step)
            with affinity.one_core():   # as benchmarks.training times it: every thread on the fastest core
                hidden += f"\n  every thread on core {affinity.LAST_CHOICE.get('core')}: " + hidden_waits(step)
        except Exception:
            places, hidden = ["failed: " + traceback.format_exc(limit=3)], ""
        print(f"\n=== {name}: {len(places)} synchronizing calls in one step", flush=True)
        for p in places[:12]:
            print("  " + p)
        print("  " + hidden, flush=True)
    if a.rounds:
        steps = {n: built.get(n) or T.build(n, cfg, data, batch=batch) for n in a.versions.split(";")}
        for name, t in benchmark_rounds(steps).items():
            print(f"=== in the benchmark's loop: {name}: {t.median:.2f} ms a step (p20 {t.p20:.2f}, p80 {t.p80:.2f})")


def benchmark_rounds(steps: dict) -> dict:
    """``steps`` timed with benchmarks.training's arguments to bench.time_rounds (its _time_built)."""
    from course_utils import bench
    with contextlib.ExitStack() as pins:
        return bench.time_rounds(steps, rounds=3, before_round=lambda i: pins.enter_context(affinity.one_core()),
                                 warmup=2, rep=10, flush_l2=False)


if __name__ == "__main__":
    main()
