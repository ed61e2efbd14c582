"""Every thread of this process on one CPU core: the host half of a fair timing of a GPU step.

A training step from Python is host work on two threads at least: the one that calls the model, and the
autograd engine's worker for the GPU, which runs the backward while the caller waits. On the course's
lent H100 machines (16 virtual cores) the scheduler moved them between cores, and the same step's time
moved with it: on one machine chapter 12's autograd step at B=8 ran 33.38 ms a step back to back
unpinned, 26.38 on two cores and 22.63 with every thread on one core
(``results/h100-80gb-hbm3/step_process_pinning.log``). Two threads that never run at once lose nothing
by sharing a core. It is no cure for a slow host: on another machine the pinned step ran 39.72 ms
(``host_after_profiler.log``), and cores differ: a fixed Python loop took 255-546 us by core on one
machine and minute, and 560-676 us on every core a few minutes later (``core_speeds_machineB.log``).

:func:`one_core` times that loop on each candidate core (:func:`core_speeds`), pins every thread that exists
now (``/proc/self/task``) to the fastest, and puts the old masks back on exit; a thread started inside
inherits the pin. Pin after building and warming up:
torch.compile's worker processes started inside would inherit it too and compile on one core.
On a system without thread affinity (macOS, Windows) it does nothing and says so.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time

TASKS = "/proc/self/task"


def supported() -> bool:
    """Whether this system lets a process set each of its threads' cores (Linux)."""
    return hasattr(os, "sched_setaffinity") and os.path.isdir(TASKS)


def thread_ids() -> list[int]:
    """The kernel's ids of this process's threads now."""
    return sorted(int(t) for t in os.listdir(TASKS))


def pick_core(index: int = 0) -> int:
    """The core for process ``index`` of several on one host (say, a rank's local index): counted down from
    the last core this process may use, so that one process a GPU gets a core of its own, and core 0
    (where many systems handle interrupts) comes last."""
    if int(index) != index or index < 0:
        raise ValueError(f"index must be an integer >= 0, got {index!r}")
    allowed = sorted(os.sched_getaffinity(0))
    return allowed[-1 - int(index) % len(allowed)]


#: the cores this process may use, as it started (before any :func:`one_core` block)
ALLOWED = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()
#: the last core :func:`one_core` chose: ``core``, its loop time and the median over the cores it probed (us)
LAST_CHOICE: dict = {}
PROBE_ROUNDS = 7   # rounds of :func:`core_speeds` behind a choice: ~0.05 s on 16 cores


def candidate_cores(index: int = 0, of: int = 1) -> list[int]:
    """The allowed cores of process ``index`` of ``of`` on one host: every ``of``-th allowed core from the
    ``index``-th, so that processes choosing at once never choose the same core, nor time each other's.
    Allowed: the cores this process could use when the module was imported (inside a :func:`one_core` block
    the thread's own mask is one core, and a nested block must still choose among all of them)."""
    allowed = sorted(ALLOWED) or sorted(os.sched_getaffinity(0))
    mine = [c for i, c in enumerate(allowed) if i % of == index % of]
    return mine or allowed


def fastest(speeds: dict[int, float]) -> int:
    """The core with the shortest loop time (a tie: the higher core, core 0 last)."""
    return min(speeds, key=lambda c: (speeds[c], -c))


@contextlib.contextmanager
def one_core(index: int = 0, of: int = 1, *, probe: bool = True):
    """Pin every thread of this process to one core inside the block; yields the core, or None where the
    system has no thread affinity.

    ``probe`` (default): the fastest of :func:`candidate_cores` ``(index, of)`` by :func:`core_speeds` at the
    moment of entry (on the lent virtual machines the same Python loop ran 2x slower on some cores than on
    others: ``results/h100-80gb-hbm3/core_speeds_*.log``); its numbers go to :data:`LAST_CHOICE`. Otherwise
    :func:`pick_core` ``(index)``."""
    if not supported():
        yield None
        return
    if probe:
        speeds = core_speeds(candidate_cores(index, of), rounds=PROBE_ROUNDS)
        core = fastest(speeds)
        LAST_CHOICE.clear()
        LAST_CHOICE.update(core=core, loop_us=speeds[core] * 1e6,
                           median_us=statistics.median(speeds.values()) * 1e6, cores_probed=len(speeds))
    else:
        core = pick_core(index)
    old = {}
    for tid in thread_ids():
        try:
            old[tid] = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, {core})
        except (ProcessLookupError, PermissionError):   # a thread that ended meanwhile, or not ours to move
            old.pop(tid, None)
    try:
        yield core
    finally:
        for tid, mask in old.items():
            with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
                os.sched_setaffinity(tid, mask)


def core_speeds(cores=None, rounds: int = 15, loop: int = 20_000) -> dict[int, float]:
    """Median seconds that this thread takes for a fixed Python loop on each core (``cores``: the ones the process
    started with, :data:`ALLOWED`, also inside a :func:`one_core` block),
    the cores visited in turn ``rounds`` times so that a burst of load elsewhere hits them alike: on a
    virtual machine a core shared with a busy neighbour shows here as a slow one. The thread's mask is
    put back after. Empty where the system has no thread affinity."""
    if not supported():
        return {}
    mask = os.sched_getaffinity(0)
    cores = sorted((ALLOWED or mask) if cores is None else cores)
    times: dict[int, list[float]] = {c: [] for c in cores}
    try:
        for _ in range(rounds):
            for c in cores:
                os.sched_setaffinity(0, {c})
                t = time.perf_counter()
                for _ in range(loop):
                    pass
                times[c].append(time.perf_counter() - t)
    finally:
        os.sched_setaffinity(0, mask)
    return {c: statistics.median(v) for c, v in times.items()}


__all__ = ["supported", "thread_ids", "pick_core", "candidate_cores", "fastest", "one_core", "core_speeds",
           "LAST_CHOICE"]
