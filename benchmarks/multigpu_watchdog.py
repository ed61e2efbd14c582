"""The multi-GPU benchmark's watchdog (benchmarks/multigpu.py): a step that hangs (a barrier no peer answers,
an NCCL call a rank never joins) makes every rank say where it was and exit, instead of waiting forever."""
from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time

import torch

WATCHDOG_S = 60.0   # no step (one check, one warm-up, one round of one impl) takes a healthy GPU this long
HUNG_EXIT = 3       # the exit status of a rank whose step outran the watchdog
HUNG_GRACE_S = 3.0  # the first rank to give up waits this long, so that its peers' own watchdogs speak too


class Watchdog:
    """Makes a hang loud and bounded. Each step names itself (:meth:`step`, which first waits for the GPU
    work queued under the previous name, so a kernel that spins is charged to the step that launched it);
    a step that has not ended ``seconds`` later makes this rank print ``HUNG rank r ... at: <step>`` and every
    thread's Python stack to stderr, then exit with HUNG_EXIT. A Python thread keeps the time (CUDA waits
    and NCCL calls release the GIL); faulthandler backs it from C ten seconds later in case they do not.
    A rank that torchrun terminates first prints its stack too. ``echo``: print every step to stderr."""

    def __init__(self, seconds: float, rank: int = 0, echo: bool = False):
        self.seconds, self.rank, self.echo = seconds, rank, echo
        self.what, self.start = "start", time.monotonic()
        self.since, self.limit, self.done = self.start, seconds, False
        if seconds > 0:
            faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
            threading.Thread(target=self._watch, name="watchdog", daemon=True).start()

    def step(self, what: str, sync: bool = True, allow: float = 1.0) -> None:
        """Begin step ``what`` (``allow`` times the watchdog's seconds: a step that compiles many kernels)."""
        if sync and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()   # the previous step's kernels finish under the previous step's name
        self.what, self.since, self.limit = what, time.monotonic(), self.seconds * allow
        if self.seconds > 0:
            faulthandler.dump_traceback_later(self.limit + 10, exit=True)
        if self.echo:
            print(f"[{self.since - self.start:7.1f} s] {what}", file=sys.stderr, flush=True)

    def close(self) -> None:
        self.done = True
        if self.seconds > 0:
            faulthandler.cancel_dump_traceback_later()

    def _watch(self) -> None:
        while not self.done:
            time.sleep(min(1.0, self.seconds / 4))
            idle = time.monotonic() - self.since
            if idle > self.limit and not self.done:
                print(f"HUNG rank {self.rank}: no progress for {idle:.0f} s (limit {self.limit:g} s, --watchdog "
                      f"{self.seconds:g}) at: {self.what}", file=sys.stderr, flush=True)
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                sys.stderr.flush()
                time.sleep(HUNG_GRACE_S)
                os._exit(HUNG_EXIT)


QUIET = Watchdog(0)   # the default: no watchdog, no echo (simulated runs, tests)
